//! Where `--model` points: an existing path (a Hugging Face folder or a .gguf file), or a
//! Hugging Face hub id (`owner/name`, optionally `owner/name@revision`) resolved to a snapshot
//! folder in the Hugging Face cache, downloading what is missing when the machine is online.
//!
//! Dependencies: std, serde_json and hf-hub's blocking API (ureq over rustls); no engine types.
//! The environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN) is read once,
//! into [`HubEnv`], by [`resolve_model`]; everything below takes a `HubEnv`, so tests pass their
//! own cache root and never touch the process environment.
//!
//! Cache layout (the one hf-hub and Python's huggingface_hub share):
//! `<cache>/models--owner--name/refs/<revision>` holds a commit hash and the files live under
//! `<cache>/models--owner--name/snapshots/<commit>/` (symlinks into `blobs/`).
//!
//! Invariant: a cached snapshot is used without any network access when it holds every
//! required file ([`REQUIRED`] and the weights: `model.safetensors`, or
//! `model.safetensors.index.json` and every shard it lists); [`OPTIONAL`] files are fetched
//! along with the rest but never by themselves.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

/// Files a model folder needs.
pub const REQUIRED: [&str; 2] = ["config.json", "tokenizer.json"];
/// Files fetched when the repository has them (chat template, special tokens, defaults).
pub const OPTIONAL: [&str; 2] = ["tokenizer_config.json", "generation_config.json"];
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHT_INDEX: &str = "model.safetensors.index.json";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

#[derive(Debug, thiserror::Error)]
pub enum ModelSourceError {
    #[error(
        "--model `{arg}` is neither an existing path (a Hugging Face folder or a .gguf file) nor a \
         Hugging Face hub id like `owner/name` or `owner/name@revision`"
    )]
    NotAModel { arg: String },
    #[error(
        "--model `{id}`: not an existing path, and the hub id is not fully in the Hugging Face cache \
         ({file} missing; looked in {looked}) while HF_HUB_OFFLINE is set"
    )]
    NotCached { id: String, file: String, looked: PathBuf },
    #[error("--model `{id}`: asking {host} about the repository failed: {source}")]
    Info { id: String, host: String, source: ApiError },
    #[error("--model `{id}`: the repository has no {file} at this revision")]
    MissingInRepo { id: String, file: String },
    #[error("--model `{id}`: downloading {file} from {host} failed: {source}")]
    Download { id: String, file: String, host: String, source: ApiError },
    #[error("--model `{id}`: setting up the Hugging Face client failed: {source}")]
    Client { id: String, source: ApiError },
    #[error("{path}: not a usable safetensors index: {reason}")]
    BadIndex { path: PathBuf, reason: String },
}

/// A parsed hub id. Invariant: `repo` is `owner/name` with both parts non-empty, made of ASCII
/// letters, digits, `-`, `_`, `.`, not starting with `-`/`.` and without `--` or `..`; `revision`
/// is non-empty without whitespace or `..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// `owner/name` or `owner/name@revision` (default revision: `main`); `None` otherwise.
    pub fn parse(s: &str) -> Option<HubId> {
        let (repo, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (s, "main"),
        };
        let (owner, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.starts_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
        };
        let rev_ok = !revision.is_empty()
            && revision.len() <= 255
            && !revision.contains("..")
            && !revision.starts_with('/')
            && revision.chars().all(|c| c.is_ascii_graphic() && c != '\\');
        (part_ok(owner) && part_ok(name) && rev_ok).then(|| HubId { repo: repo.into(), revision: revision.into() })
    }

    /// `owner/name@revision` as the user would write it (no `@main`).
    pub fn display(&self) -> String {
        if self.revision == "main" {
            self.repo.clone()
        } else {
            format!("{}@{}", self.repo, self.revision)
        }
    }

    /// `<cache>/models--owner--name`.
    fn repo_dir(&self, cache: &Path) -> PathBuf {
        cache.join(format!("models--{}", self.repo.replace('/', "--")))
    }

    /// A 40-hex revision is a commit itself; anything else is a ref name.
    fn commit_literal(&self) -> Option<&str> {
        (self.revision.len() == 40 && self.revision.chars().all(|c| c.is_ascii_hexdigit())).then_some(&self.revision)
    }
}

/// What hub resolution needs from the environment, read once at startup.
#[derive(Debug, Clone)]
pub struct HubEnv {
    /// Hub cache root (the folder holding `models--owner--name/`).
    pub cache: PathBuf,
    /// Never touch the network (HF_HUB_OFFLINE).
    pub offline: bool,
    /// Hub base URL (HF_ENDPOINT, default https://huggingface.co).
    pub endpoint: String,
    /// Access token (HF_TOKEN; else hf-hub reads `$HF_HOME/token`).
    pub token: Option<String>,
}

impl HubEnv {
    /// The cache root as hf-hub and huggingface_hub find it: HF_HUB_CACHE, else `$HF_HOME/hub`,
    /// else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
    pub fn from_env() -> HubEnv {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let cache = var("HF_HUB_CACHE")
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let offline = std::env::var("HF_HUB_OFFLINE").map(|v| truthy(&v)).unwrap_or(false);
        let endpoint =
            std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()).unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        let token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        HubEnv { cache, offline, endpoint, token }
    }

    /// The endpoint's host, for error messages.
    fn host(&self) -> String {
        let rest = self.endpoint.split_once("://").map_or(self.endpoint.as_str(), |(_, r)| r);
        rest.split(['/', '?']).next().unwrap_or(rest).to_string()
    }
}

/// Python's huggingface_hub reading of a boolean variable.
fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")
}

/// `--model` as given -> a local path: an existing path as is, a hub id through the Hugging Face
/// cache (downloading what is missing unless HF_HUB_OFFLINE is set).
pub fn resolve_model(arg: &Path) -> anyhow::Result<PathBuf> {
    Ok(resolve_with(arg, &HubEnv::from_env())?)
}

/// [`resolve_model`] for the serving commands: a hub id also becomes the served model name when
/// none was given (otherwise the name would be the snapshot's commit hash).
pub fn resolve_named(model: &mut PathBuf, served_name: &mut Option<String>) -> anyhow::Result<()> {
    if !model.exists() {
        if let Some(id) = model.to_str().and_then(HubId::parse) {
            served_name.get_or_insert(id.repo);
        }
    }
    *model = resolve_model(model)?;
    Ok(())
}

/// [`resolve_model`] with the environment passed in.
pub fn resolve_with(arg: &Path, env: &HubEnv) -> Result<PathBuf, ModelSourceError> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let text = arg.to_string_lossy();
    let id = HubId::parse(&text).ok_or_else(|| ModelSourceError::NotAModel { arg: text.to_string() })?;
    match cached_snapshot(&id, &env.cache)? {
        Ok(snapshot) => Ok(snapshot),
        Err(missing) if env.offline => {
            Err(ModelSourceError::NotCached { id: id.display(), file: missing.file, looked: missing.looked })
        }
        Err(_) => download(&id, env),
    }
}

/// The first thing a cached snapshot lacks.
#[derive(Debug)]
struct Missing {
    file: String,
    looked: PathBuf,
}

/// The cached snapshot folder when it holds every required file; else what is missing.
fn cached_snapshot(id: &HubId, cache: &Path) -> Result<Result<PathBuf, Missing>, ModelSourceError> {
    let repo_dir = id.repo_dir(cache);
    let commit = match id.commit_literal() {
        Some(c) => c.to_string(),
        None => {
            let ref_path = repo_dir.join("refs").join(&id.revision);
            match std::fs::read_to_string(&ref_path) {
                Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
                _ => return Ok(Err(Missing { file: format!("refs/{}", id.revision), looked: repo_dir })),
            }
        }
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    let missing = |file: &str| Missing { file: file.to_string(), looked: snapshot.clone() };
    for file in REQUIRED {
        if !snapshot.join(file).is_file() {
            return Ok(Err(missing(file)));
        }
    }
    if !snapshot.join(SINGLE_WEIGHTS).is_file() {
        let index = snapshot.join(WEIGHT_INDEX);
        if !index.is_file() {
            return Ok(Err(missing(&format!("{SINGLE_WEIGHTS} (or {WEIGHT_INDEX})"))));
        }
        for shard in shards(&index)? {
            if !snapshot.join(&shard).is_file() {
                return Ok(Err(missing(&shard)));
            }
        }
    }
    Ok(Ok(snapshot))
}

/// The shard files a `model.safetensors.index.json` lists (sorted, each once). Rejects names that
/// would leave the snapshot folder.
fn shards(index: &Path) -> Result<Vec<String>, ModelSourceError> {
    let bad = |reason: String| ModelSourceError::BadIndex { path: index.to_path_buf(), reason };
    let text = std::fs::read_to_string(index).map_err(|e| bad(e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no weight_map object".into()))?;
    let mut files = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| bad(format!("weight_map[{tensor}] is not a string")))?;
        let safe = !file.is_empty()
            && !file.starts_with('/')
            && !file.contains('\\')
            && file.split('/').all(|p| !p.is_empty() && p != "." && p != "..");
        if !safe {
            return Err(bad(format!("shard name `{file}` is not a plain relative path")));
        }
        files.push(file.to_string());
    }
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(bad("weight_map is empty".into()));
    }
    Ok(files)
}

/// Asks the hub which files the revision has, downloads the ones the cache lacks into it, and
/// returns the snapshot folder of the revision's commit.
fn download(id: &HubId, env: &HubEnv) -> Result<PathBuf, ModelSourceError> {
    let host = env.host();
    let mut builder = ApiBuilder::from_cache(Cache::new(env.cache.clone())).with_endpoint(env.endpoint.clone());
    if env.token.is_some() {
        builder = builder.with_token(env.token.clone());
    }
    let api = builder.build().map_err(|source| ModelSourceError::Client { id: id.display(), source })?;
    let repo = api.repo(Repo::with_revision(id.repo.clone(), RepoType::Model, id.revision.clone()));
    let info = repo.info().map_err(|source| ModelSourceError::Info { id: id.display(), host: host.clone(), source })?;
    let has = |f: &str| info.siblings.iter().any(|s| s.rfilename == f);
    let snapshot = id.repo_dir(&env.cache).join("snapshots").join(&info.sha);
    let fetch = |file: &str| -> Result<(), ModelSourceError> {
        if snapshot.join(file).is_file() {
            return Ok(());
        }
        eprintln!("downloading {}/{file} from {host}", id.display());
        repo.download(file).map(drop).map_err(|source| ModelSourceError::Download {
            id: id.display(),
            file: file.to_string(),
            host: host.clone(),
            source,
        })
    };
    for file in REQUIRED {
        if !has(file) {
            return Err(ModelSourceError::MissingInRepo { id: id.display(), file: file.into() });
        }
        fetch(file)?;
    }
    for file in OPTIONAL.into_iter().filter(|f| has(f)) {
        fetch(file)?;
    }
    if has(SINGLE_WEIGHTS) {
        fetch(SINGLE_WEIGHTS)?;
    } else if has(WEIGHT_INDEX) {
        fetch(WEIGHT_INDEX)?;
        for shard in shards(&snapshot.join(WEIGHT_INDEX))? {
            fetch(&shard)?;
        }
    } else {
        return Err(ModelSourceError::MissingInRepo {
            id: id.display(),
            file: format!("{SINGLE_WEIGHTS} (or {WEIGHT_INDEX})"),
        });
    }
    // hf-hub points the ref at each file's commit; make sure the requested ref names this one.
    if id.commit_literal().is_none() {
        let ref_path = id.repo_dir(&env.cache).join("refs").join(&id.revision);
        let written = ref_path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&ref_path, &info.sha));
        if let Err(e) = written {
            eprintln!("warning: could not record {} -> {}: {e}", ref_path.display(), info.sha);
        }
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty folder for one test (removed by the test when it passes).
    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cleave-model-source-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn offline(cache: &Path) -> HubEnv {
        HubEnv { cache: cache.into(), offline: true, endpoint: DEFAULT_ENDPOINT.into(), token: None }
    }

    /// `models--owner--name` with `refs/main` -> `commit` and the given files (name, contents).
    fn fake_repo(cache: &Path, repo: &str, commit: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
        std::fs::create_dir_all(dir.join("refs")).unwrap();
        std::fs::write(dir.join("refs/main"), commit).unwrap();
        let snap = dir.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        for (name, body) in files {
            std::fs::write(snap.join(name), body).unwrap();
        }
        snap
    }

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn hub_ids_parse() {
        let id = HubId::parse("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("HuggingFaceTB/SmolLM2-135M-Instruct", "main"));
        let id = HubId::parse("org/m.v1_x@refs/pr/3").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_str()), ("org/m.v1_x", "refs/pr/3"));
        assert_eq!(id.display(), "org/m.v1_x@refs/pr/3");
        for bad in [
            "gpt2",
            "a/b/c",
            "/abs/path",
            "./rel/x",
            "a/",
            "/b",
            "a/b@",
            "a b/c",
            "a/b@x y",
            "../x",
            "a/..",
            "a--b/c",
            "-a/b",
            "a/b@../../etc",
            "",
            "model.gguf",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_existing_path_is_returned_as_is() {
        let dir = temp_dir("existing");
        let env = offline(&dir.join("no-cache"));
        assert_eq!(resolve_with(&dir, &env).unwrap(), dir);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_cached_id_resolves_to_its_snapshot_offline() {
        let cache = temp_dir("cached");
        let files = [("config.json", "{}"), ("tokenizer.json", "{}"), ("model.safetensors", "")];
        let snap = fake_repo(&cache, "owner/name", COMMIT, &files);
        assert_eq!(resolve_with(Path::new("owner/name"), &offline(&cache)).unwrap(), snap);
        // A commit hash as the revision needs no ref.
        std::fs::remove_file(cache.join("models--owner--name/refs/main")).unwrap();
        assert_eq!(resolve_with(Path::new(&format!("owner/name@{COMMIT}")), &offline(&cache)).unwrap(), snap);
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn offline_misses_name_the_file_and_the_folder() {
        let cache = temp_dir("miss");
        let err = resolve_with(Path::new("owner/absent"), &offline(&cache)).unwrap_err();
        match &err {
            ModelSourceError::NotCached { id, file, looked } => {
                assert_eq!((id.as_str(), file.as_str()), ("owner/absent", "refs/main"));
                assert_eq!(looked, &cache.join("models--owner--absent"));
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("HF_HUB_OFFLINE"), "{err}");
        let snap = fake_repo(&cache, "owner/name", COMMIT, &[("config.json", "{}")]);
        match resolve_with(Path::new("owner/name"), &offline(&cache)).unwrap_err() {
            ModelSourceError::NotCached { file, looked, .. } => {
                assert_eq!((file.as_str(), looked), ("tokenizer.json", snap))
            }
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn sharded_weights_need_every_listed_shard() {
        let cache = temp_dir("shards");
        let index = r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "c": "model-00001-of-00002.safetensors"}}"#;
        let files = [
            ("config.json", "{}"),
            ("tokenizer.json", "{}"),
            (WEIGHT_INDEX, index),
            ("model-00001-of-00002.safetensors", ""),
        ];
        let snap = fake_repo(&cache, "owner/sharded", COMMIT, &files);
        match resolve_with(Path::new("owner/sharded"), &offline(&cache)).unwrap_err() {
            ModelSourceError::NotCached { file, .. } => assert_eq!(file, "model-00002-of-00002.safetensors"),
            other => panic!("{other:?}"),
        }
        std::fs::write(snap.join("model-00002-of-00002.safetensors"), "").unwrap();
        assert_eq!(resolve_with(Path::new("owner/sharded"), &offline(&cache)).unwrap(), snap);
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn an_index_pointing_outside_the_snapshot_is_refused() {
        let cache = temp_dir("badindex");
        let index = r#"{"weight_map": {"a": "../../../etc/passwd"}}"#;
        let files = [("config.json", "{}"), ("tokenizer.json", "{}"), (WEIGHT_INDEX, index)];
        fake_repo(&cache, "owner/evil", COMMIT, &files);
        let err = resolve_with(Path::new("owner/evil"), &offline(&cache)).unwrap_err();
        assert!(matches!(err, ModelSourceError::BadIndex { .. }), "{err:?}");
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn nonsense_is_neither_a_path_nor_an_id() {
        let env = offline(Path::new("/nonexistent-cache"));
        let err = resolve_with(Path::new("/no/such/model.gguf"), &env).unwrap_err();
        assert!(matches!(err, ModelSourceError::NotAModel { .. }), "{err:?}");
        assert!(err.to_string().contains("neither an existing path"), "{err}");
    }

    /// A hub that answers 404 to every request (for at most `n` connections).
    fn not_found_hub(n: usize) -> String {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(n) {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).map(|k| k > 2).unwrap_or(false) {
                    line.clear();
                }
                let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn online_misses_ask_the_hub_and_name_its_host() {
        let cache = temp_dir("online");
        let endpoint = not_found_hub(4);
        let env = HubEnv { cache: cache.clone(), offline: false, endpoint: endpoint.clone(), token: None };
        let err = resolve_with(Path::new("owner/name"), &env).unwrap_err();
        assert!(matches!(err, ModelSourceError::Info { .. }), "{err:?}");
        let host = endpoint.trim_start_matches("http://");
        assert!(err.to_string().contains(host) && err.to_string().contains("owner/name"), "{err}");
        std::fs::remove_dir_all(&cache).unwrap();
    }

    /// A minimal hub for `owner/name` at commit [`COMMIT`] serving `files`: the repo info API, and
    /// `resolve/main/<file>` with the headers hf-hub reads (etag, x-repo-commit, content-range).
    /// Answers at most `n` requests, each on its own connection.
    fn fake_hub(files: Vec<(&'static str, Vec<u8>)>, n: usize) -> String {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(n) {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let (mut first, mut range, mut line) = (String::new(), None, String::new());
                reader.read_line(&mut first).unwrap();
                while reader.read_line(&mut line).map(|k| k > 2).unwrap_or(false) {
                    if let Some(r) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                        let (a, b) = r.trim().split_once('-').unwrap();
                        range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                    }
                    line.clear();
                }
                let path = first.split(' ').nth(1).unwrap_or("");
                let (status, headers, body) = if path.starts_with("/api/models/owner/name") {
                    let siblings: Vec<_> = files.iter().map(|(f, _)| serde_json::json!({ "rfilename": f })).collect();
                    let info = serde_json::json!({ "sha": COMMIT, "siblings": siblings });
                    ("200 OK", String::new(), info.to_string().into_bytes())
                } else if let Some((name, data)) =
                    files.iter().find(|(f, _)| path == format!("/owner/name/resolve/main/{f}"))
                {
                    let (a, b) = range.unwrap_or((0, None));
                    let b = b.unwrap_or(data.len() - 1).min(data.len() - 1);
                    let headers = format!(
                        "ETag: \"etag-{name}\"\r\nX-Repo-Commit: {COMMIT}\r\nContent-Range: bytes {a}-{b}/{}\r\n",
                        data.len()
                    );
                    ("206 Partial Content", headers, data[a..=b].to_vec())
                } else {
                    ("404 Not Found", String::new(), Vec::new())
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&body));
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn online_misses_download_every_needed_file_then_work_offline() {
        let cache = temp_dir("download");
        let index =
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#;
        let files: Vec<(&str, Vec<u8>)> = vec![
            ("config.json", b"{\"hidden_size\": 8}".to_vec()),
            ("tokenizer.json", b"{\"model\": {}}".to_vec()),
            ("tokenizer_config.json", b"{}".to_vec()),
            ("README.md", b"not fetched".to_vec()),
            (WEIGHT_INDEX, index.as_bytes().to_vec()),
            ("model-00001-of-00002.safetensors", vec![1u8; 300]),
            ("model-00002-of-00002.safetensors", vec![2u8; 7]),
        ];
        let endpoint = fake_hub(files.clone(), 64);
        let env = HubEnv { cache: cache.clone(), offline: false, endpoint, token: None };
        let snap = resolve_with(Path::new("owner/name"), &env).unwrap();
        assert_eq!(snap, cache.join("models--owner--name/snapshots").join(COMMIT));
        for (name, data) in &files {
            if *name == "README.md" {
                assert!(!snap.join(name).exists());
            } else {
                assert_eq!(&std::fs::read(snap.join(name)).unwrap(), data, "{name}");
            }
        }
        assert_eq!(std::fs::read_to_string(cache.join("models--owner--name/refs/main")).unwrap(), COMMIT);
        assert_eq!(resolve_with(Path::new("owner/name"), &offline(&cache)).unwrap(), snap);
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn a_repo_without_weights_is_named_as_such() {
        let cache = temp_dir("noweights");
        let files = vec![("config.json", b"{}".to_vec()), ("tokenizer.json", b"{}".to_vec())];
        let env = HubEnv { cache: cache.clone(), offline: false, endpoint: fake_hub(files, 16), token: None };
        let err = resolve_with(Path::new("owner/name"), &env).unwrap_err();
        assert!(
            matches!(&err, ModelSourceError::MissingInRepo { file, .. } if file.starts_with(SINGLE_WEIGHTS)),
            "{err:?}"
        );
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn endpoint_host_for_messages() {
        let mut env = offline(Path::new("/x"));
        assert_eq!(env.host(), "huggingface.co");
        env.endpoint = "http://127.0.0.1:8080/mirror".into();
        assert_eq!(env.host(), "127.0.0.1:8080");
        assert!(truthy("1") && truthy("TRUE") && !truthy("0") && !truthy(""));
    }
}
