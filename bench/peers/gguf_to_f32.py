#!/usr/bin/env python3
"""Rewrites a GGUF file with every tensor de-quantized to F32, keeping all metadata (architecture,
hyper-parameters, tokenizer, chat template) as it is.

Used by BENCHMARKS.md to give llama.cpp and cleave the *same* F32 model: SmolLM2-135M-Instruct's
Q4_1 file de-quantized, so both engines compute in f32 on identical weights.

    python gguf_to_f32.py IN.gguf OUT.gguf      (needs `pip install gguf numpy`)
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, GGMLQuantizationType
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        if name == "general.file_type":
            w.add_uint32(name, 0)  # LLAMA_FTYPE_ALL_F32
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        # GGUF shapes list the fastest dimension first; numpy wants it last.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, data, raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
