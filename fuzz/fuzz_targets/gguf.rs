//! The GGUF reader (`cleave_engine::model::gguf`) and the engine's GGUF load path
//! ([`ModelFiles::from_gguf_bytes`], the same code `ModelFiles::open` runs on a `.gguf` file).
//!
//! The input is a whole GGUF image. What must hold:
//! - nothing panics and no allocation outgrows the input by more than the largest
//!   quantization ratio (the reader bounds every count by the bytes left; the fuzz crate's
//!   allocator aborts on a single allocation past 256 MiB);
//! - every tensor the reader accepts lies inside the image and has as many bytes as its type and
//!   shape need, and dequantizing it either works or says why;
//! - a file the engine accepts as a model yields every tensor its config implies with the
//!   shape the config implies, a tokenizer that encodes and decodes, and a chat template that
//!   renders or fails with an error (never a hang: rendering is bounded).
#![no_main]

use std::path::Path;

use cleave_engine::model::gguf::{GgufFile, GgufModel};
use cleave_engine::model::ModelFiles;
use cleave_tokenizer::{ChatMessage, ChatOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else { return };
    assert!(file.version() == 2 || file.version() == 3);
    assert!(file.alignment().is_power_of_two());
    for (_, value) in file.metadata() {
        let _ = (value.type_name(), value.as_int(), value.as_f32());
    }
    for info in file.tensors() {
        let bytes = file.tensor_bytes(info);
        assert_eq!(bytes.len() as u64, info.n_bytes);
        let (block, size) = info.ggml_type.block_layout();
        assert_eq!(info.n_elements / block as u64 * size as u64, info.n_bytes);
        if let Ok(values) = file.tensor_f32(&info.name) {
            assert_eq!(values.len() as u64, info.n_elements);
        }
    }
    let Ok(model) = GgufModel::from_file(file) else { return };
    let Ok(files) = ModelFiles::from_gguf_bytes(Path::new("fuzz.gguf"), data.to_vec()) else { return };
    for (name, shape) in model.expected_tensors() {
        if let Ok(values) = files.source.load(&name, &shape) {
            assert_eq!(values.len(), shape.iter().product::<usize>(), "{name}");
        }
    }
    let tok = &files.tokenizer;
    if let Ok(ids) = tok.encode("Hello, world! 12 é", false) {
        let _ = tok.decode(&ids, false);
    }
    let conversation = [ChatMessage::system("S"), ChatMessage::user("Hi"), ChatMessage::assistant("Yo")];
    let opts = ChatOptions { add_generation_prompt: true, now_unix_secs: Some(0), ..Default::default() };
    let _ = tok.render_chat_with(&conversation, &opts);
});
