{{/* Names. */}}
{{- define "cleave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cleave.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's object name: <fullname>-<component>. Pod names add "-<hash>-<5 chars>" to a
Deployment's name and must stay within 63 characters (they are node names, DNS labels). */}}
{{- define "cleave.component" -}}
{{- $name := printf "%s-%s" (include "cleave.fullname" .root) .component }}
{{- if gt (len $name) 47 }}
{{- fail (printf "%s is %d characters: Deployment names here must be at most 47 (their pods' names become node names, DNS labels of at most 63); shorten the release name or set fullnameOverride" $name (len $name)) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "cleave.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cleave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "cleave.selector" -}}
app.kubernetes.io/name: {{ include "cleave.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cleave.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cleave.serviceAccount" -}}
{{- default (printf "%s-coordinator" (include "cleave.fullname" .)) .Values.serviceAccount.name }}
{{- end }}

{{- define "cleave.caSecret" -}}
{{- default (printf "%s-ca" (include "cleave.fullname" .)) .Values.certs.existingSecret }}
{{- end }}

{{- define "cleave.adminSecret" -}}
{{- default (printf "%s-admin" (include "cleave.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "cleave.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "cleave.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{/* The protocol of the internal ports. */}}
{{- define "cleave.protocol" -}}
{{- if eq .Values.transport "quic" }}UDP{{ else }}TCP{{ end }}
{{- end }}

{{/* The address nodes register at: the cluster Service's pinned IP, or the environment variable
Kubernetes sets for it (expanded by the kubelet in args). */}}
{{- define "cleave.coordinatorAddr" -}}
{{- $svc := include "cleave.component" (dict "root" . "component" "cluster") }}
{{- if .Values.coordinator.clusterService.clusterIP }}
{{- printf "%s:%d" .Values.coordinator.clusterService.clusterIP (int .Values.coordinator.clusterService.port) }}
{{- else }}
{{- printf "$(%s_SERVICE_HOST):%d" ($svc | upper | replace "-" "_") (int .Values.coordinator.clusterService.port) }}
{{- end }}
{{- end }}

{{/* Whether the planner owns the node Deployments' replicas. */}}
{{- define "cleave.plannerScales" -}}
{{- if and (eq .Values.actuator.kind "kubernetes") (eq .Values.planner.mode "auto") }}true{{ end }}
{{- end }}

{{/* The model volume. */}}
{{- define "cleave.modelVolume" -}}
- name: model
{{- if and .Values.model.pvc.claimName .Values.model.hostPath.path }}
{{- fail "set one of model.pvc.claimName and model.hostPath.path, not both" }}
{{- else if .Values.model.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if .Values.model.hostPath.path }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    {{- with .Values.model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else }}
{{- fail "the model needs a volume: set model.pvc.claimName or model.hostPath.path" }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations for a pod serving /metrics on `port`. */}}
{{- define "cleave.scrape" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Volumes and the init container that give a pod its certificate: `name` is the node name
(a literal, or "$(POD_NAME)"). The CA key stays in the init container's mount; the main
container sees /certs with ca.crt, <name>.crt and <name>.key only. */}}
{{- define "cleave.certVolumes" -}}
- name: ca
  secret:
    secretName: {{ include "cleave.caSecret" . }}
    defaultMode: 0400
- name: certs
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end }}

{{- define "cleave.certInit" -}}
- name: certs
  image: {{ include "cleave.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["/bin/sh", "-c"]
  args:
    - |
      set -eu
      umask 077
      cp /ca/ca.crt /ca/ca.key /certs/
      {{ .root.Values.image.binary }} certs --dir /certs --nodes "$CLEAVE_NODE_NAME" --roles {{ .roles | default "node" }} >/dev/null
      rm -f /certs/ca.key
      echo "issued the certificate of $CLEAVE_NODE_NAME"
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: CLEAVE_NODE_NAME
      value: {{ .name | quote }}
  {{- with .root.Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - name: ca
      mountPath: /ca
      readOnly: true
    - name: certs
      mountPath: /certs
{{- end }}
