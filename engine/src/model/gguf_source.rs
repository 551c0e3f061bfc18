//! A GGUF file seen as [`ModelFiles`]: its config mapped to [`ModelConfig`], its tokenizer and
//! chat template wrapped as a [`Tokenizer`], and its tensors as a [`TensorSource`] in Hugging
//! Face naming: linear weights in a format the kernels multiply stay quantized, F16 and BF16 ones
//! stay in 16 bits ([`TensorSource::load_linear`]), everything else is dequantized on load.

use std::path::Path;

use cleave_kernels::RopeScaling;
use cleave_tokenizer::{Tokenizer, TokenizerConfig};

use super::gguf::{GgufError, GgufFile, GgufModel};
use super::{Architecture, LinearWeight, ModelConfig, ModelFiles, TensorSource};
use crate::{EngineError, Result};

/// The tensors of an open GGUF file, with its path for error messages.
struct GgufSource {
    path: std::path::PathBuf,
    model: GgufModel,
}

impl GgufSource {
    /// Checks that tensor `name` exists with exactly `shape`.
    fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()> {
        let actual = self.model.tensor_shape(name).map_err(|_| EngineError::MissingTensor { name: name.into() })?;
        if actual != shape {
            return Err(EngineError::TensorShape { name: name.into(), expected: shape.to_vec(), actual });
        }
        Ok(())
    }

    fn file_err(&self, e: GgufError) -> EngineError {
        EngineError::ModelFile { path: self.path.clone(), detail: e.to_string() }
    }
}

impl TensorSource for GgufSource {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.check_shape(name, shape)?;
        Ok(self.model.tensor_f32(name).map_err(|e| self.file_err(e))?.1)
    }

    fn load_linear(&self, name: &str, shape: [usize; 2]) -> Result<LinearWeight> {
        self.check_shape(name, &shape)?;
        if let Some(q) = self.model.tensor_quantized(name).map_err(|e| self.file_err(e))? {
            return Ok(LinearWeight::Quantized(q));
        }
        match self.model.tensor_half(name).map_err(|e| self.file_err(e))? {
            Some(h) => Ok(LinearWeight::Half(h)),
            None => self.load(name, &shape).map(LinearWeight::F32),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.model.tensor_shape(name).is_ok()
    }
}

pub(super) fn open_gguf(path: &Path) -> Result<ModelFiles> {
    let gguf = GgufModel::open(path)
        .map_err(|e| EngineError::ModelFile { path: path.to_path_buf(), detail: e.to_string() })?;
    model_files(path, gguf)
}

/// [`open_gguf`] of an image held in memory; `path` only names it in errors and in
/// [`ModelFiles::path`]. The file and this share every step after the bytes are in hand.
pub(super) fn gguf_from_bytes(path: &Path, bytes: Vec<u8>) -> Result<ModelFiles> {
    let gguf = GgufFile::from_bytes(bytes)
        .and_then(GgufModel::from_file)
        .map_err(|e| EngineError::ModelFile { path: path.to_path_buf(), detail: e.to_string() })?;
    model_files(path, gguf)
}

fn model_files(path: &Path, gguf: GgufModel) -> Result<ModelFiles> {
    let model_file_err = |detail: String| EngineError::ModelFile { path: path.to_path_buf(), detail };
    let g = &gguf.config;
    let architecture = match g.architecture.as_str() {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        other => return Err(EngineError::UnsupportedArchitecture { arch: format!("{other} (GGUF)") }),
    };
    if g.has_rope_freqs {
        return Err(model_file_err(
            "the file carries `rope_freqs.weight` (llama3 rope scaling as a tensor), which cleave does not read yet; \
             load the Hugging Face folder of this model instead"
                .into(),
        ));
    }
    let rope_scaling = match &g.rope_scaling {
        None => RopeScaling::None,
        Some(rs) if rs.kind == "linear" => RopeScaling::Linear { factor: rs.factor },
        Some(rs) if rs.kind == "none" => RopeScaling::None,
        Some(rs) => return Err(model_file_err(format!("rope scaling `{}` is not supported", rs.kind))),
    };
    let config = ModelConfig {
        architecture,
        vocab_size: g.vocab_size,
        hidden_size: g.hidden_size,
        intermediate_size: g.intermediate_size,
        num_layers: g.num_layers,
        num_heads: g.num_heads,
        num_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        rms_norm_eps: g.rms_norm_eps,
        rope_theta: g.rope_theta,
        rope_scaling,
        max_position_embeddings: g.max_position_embeddings,
        tie_word_embeddings: g.tie_word_embeddings,
        attention_bias: g.attention_bias,
        qk_norm: g.qk_norm,
        bos_token_id: g.bos_token_id,
        eos_token_ids: g.eos_token_id.into_iter().collect(),
    };
    let token_text = |id: Option<u32>| id.and_then(|id| gguf.tokenizer.id_to_token(id));
    let mut tcfg = TokenizerConfig {
        bos_token: token_text(g.bos_token_id),
        eos_token: token_text(g.eos_token_id),
        ..Default::default()
    };
    if let Some(template) = gguf.chat_template.clone() {
        tcfg.set_chat_template(cleave_tokenizer::DEFAULT_TEMPLATE_NAME, template);
    }
    let tokenizer = Tokenizer::from_hf(gguf.tokenizer.clone(), tcfg);
    Ok(ModelFiles {
        path: path.to_path_buf(),
        config,
        tokenizer,
        source: Box::new(GgufSource { path: path.to_path_buf(), model: gguf }),
    })
}
