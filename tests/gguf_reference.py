"""Checks `cleave quantize`'s GGUF files with llama.cpp's own Python package (gguf-py).

usage: gguf_reference.py SOURCE.gguf OUTPUT.gguf...

For each output: every metadata key of the source is there with its value (general.file_type
apart), every tensor has the source's name and shape, and gguf-py's dequantization of the
output's blocks is close to its dequantization of the source's (relative RMS error under the
format's bound). Where gguf-py has a reference quantizer for the format (the round-to-nearest
ones), the output's bytes equal what that quantizer makes of the source's values.
"""

import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

BOUND = {
    T.F32: 1e-7, T.F16: 1e-3, T.Q8_0: 0.01, T.Q6_K: 0.03,
    T.Q5_0: 0.06, T.Q5_1: 0.06, T.Q5_K: 0.06, T.Q4_0: 0.12, T.Q4_1: 0.12, T.Q4_K: 0.12,
}
ROUND_TO_NEAREST = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}


def fields(r):
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = [bytes(f.parts[i]) for i in f.data]
    return out


def main():
    src = GGUFReader(sys.argv[1])
    src_fields = fields(src)
    src_tensors = {t.name: t for t in src.tensors}
    for path in sys.argv[2:]:
        out = GGUFReader(path)
        out_fields = fields(out)
        for k, v in src_fields.items():
            if k != "general.file_type":
                assert out_fields.get(k) == v, f"{path}: metadata {k} differs or is missing"
        assert "general.file_type" in out_fields, path
        assert len(out.tensors) == len(src_tensors), path
        exact = checked = 0
        types = {}
        for t in out.tensors:
            s = src_tensors[t.name]
            assert list(t.shape) == list(s.shape), f"{t.name}: {t.shape} != {s.shape}"
            x = dequantize(s.data, s.tensor_type).astype(np.float32).reshape(-1)
            y = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
            assert x.shape == y.shape, t.name
            rms = float(np.sqrt(np.mean(x * x))) or 1.0
            err = float(np.sqrt(np.mean((x - y) ** 2))) / rms
            assert err < BOUND[t.tensor_type], f"{path}: {t.name} ({t.tensor_type.name}): relative RMS error {err}"
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            if t.tensor_type in ROUND_TO_NEAREST:
                k = int(t.shape[0])
                try:
                    ref = quantize(x.reshape(-1, k), t.tensor_type)
                except NotImplementedError:
                    continue
                checked += 1
                if np.array_equal(np.asarray(ref).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8)):
                    exact += 1
        assert exact == checked, f"{path}: {checked - exact} of {checked} tensors differ from gguf-py's quantizer"
        print(f"{path}: {len(out.tensors)} tensors {types}, {checked} byte-identical to gguf-py's quantizer")


if __name__ == "__main__":
    main()
