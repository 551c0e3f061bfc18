"""Checks `cleave quantize`'s GGUF of a Hugging Face folder with llama.cpp's own Python package.

usage: gguf_from_hf_reference.py HF_FOLDER OUTPUT.gguf

Written from llama.cpp's conventions, not from cleave's code: every tensor of the folder's
model.safetensors is in the GGUF under llama.cpp's name with ggml's reversed shape; llama's
q_proj/k_proj rows are permuted as convert_hf_to_gguf.py's `permute` does; gguf-py's
dequantization of each matrix is close to the folder's values and, for the round-to-nearest
formats, its bytes equal gguf-py's quantizer applied to them; vectors are f32 and exact. The
vocabulary is tokenizer.json's, id by id (added tokens typed control when special), with its
merges, and the hyperparameters are config.json's.
"""

import json
import struct
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

BOUND = {T.F16: 1e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_0: 0.06, T.Q5_1: 0.06, T.Q5_K: 0.06,
         T.Q4_0: 0.12, T.Q4_1: 0.12, T.Q4_K: 0.12}
ROUND_TO_NEAREST = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
DTYPES = {"F32": np.float32, "F16": np.float16}


def safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if t["dtype"] == "BF16":
            x = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(buf, dtype=DTYPES[t["dtype"]]).astype(np.float32)
        out[name] = x.reshape(t["shape"])
    return out


def gguf_name(hf):
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[stem]}.{kind}"


def permute(w, n_head):
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field(r, name):
    f = r.fields[name]
    if len(f.data) == 1 and name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0].name == "STRING" else v.tolist()[0]
    if f.types[-1].name == "STRING":
        return [bytes(f.parts[i]).decode() for i in f.data]
    return [f.parts[i].tolist()[0] for i in f.data]


def main():
    folder, path = sys.argv[1], sys.argv[2]
    cfg = json.load(open(f"{folder}/config.json"))
    tok = json.load(open(f"{folder}/tokenizer.json"))
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    assert arch == "llama", arch
    for key, want in [("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                      ("block_count", cfg["num_hidden_layers"]), ("attention.head_count", cfg["num_attention_heads"]),
                      ("attention.head_count_kv", cfg["num_key_value_heads"]),
                      ("context_length", cfg["max_position_embeddings"])]:
        assert field(r, f"{arch}.{key}") == want, (key, field(r, f"{arch}.{key}"), want)
    assert abs(field(r, f"{arch}.attention.layer_norm_rms_epsilon") - cfg["rms_norm_eps"]) < 1e-12
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a for a in tok["added_tokens"]}
    for i, a in special.items():
        vocab[i] = a["content"]
    tokens, types = field(r, "tokenizer.ggml.tokens"), field(r, "tokenizer.ggml.token_type")
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    assert len(tokens) == cfg["vocab_size"], len(tokens)
    for i, t in vocab.items():
        assert tokens[i] == t, (i, tokens[i], t)
        assert types[i] == (3 if i in special and special[i]["special"] else 1), (i, types[i])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert field(r, "tokenizer.ggml.merges") == merges
    tensors = {t.name: t for t in r.tensors}
    weights = safetensors(f"{folder}/model.safetensors")
    assert len(tensors) == len(weights), (len(tensors), len(weights))
    exact = checked = 0
    for hf, x in weights.items():
        t = tensors[gguf_name(hf)]
        assert list(t.shape) == list(reversed(x.shape)), (hf, t.shape, x.shape)
        if ".q_proj." in hf:
            x = permute(x, cfg["num_attention_heads"])
        elif ".k_proj." in hf:
            x = permute(x, cfg["num_key_value_heads"])
        y = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(x.shape)
        if x.ndim == 1:
            assert t.tensor_type == T.F32 and np.array_equal(x, y), hf
            continue
        rms = float(np.sqrt(np.mean(x * x))) or 1.0
        err = float(np.sqrt(np.mean((x - y) ** 2))) / rms
        assert err < BOUND[t.tensor_type], f"{hf} ({t.tensor_type.name}): relative RMS error {err}"
        if t.tensor_type in ROUND_TO_NEAREST:
            checked += 1
            ref = quantize(x, t.tensor_type)
            exact += np.array_equal(np.asarray(ref).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))
    assert exact == checked, f"{checked - exact} of {checked} matrices differ from gguf-py's quantizer"
    print(f"{path}: {len(tensors)} tensors, vocabulary of {len(tokens)} and {len(merges)} merges as tokenizer.json, "
          f"{checked} matrices byte-identical to gguf-py's quantizer of the folder's (permuted) values")


if __name__ == "__main__":
    main()
