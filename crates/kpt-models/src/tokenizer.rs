//! Text to token ids and back, through the `tokenizers` crate and `tokenizer.json`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::config::{Fields, SpecialTokens};
use crate::error::{ModelError, Result};

/// The file name of a serialized Hugging Face tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// A loaded `tokenizer.json` with the model's special token ids.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    special: SpecialTokens,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`. Special ids come from `generation_config.json`, then
    /// `from_config` (the model's `config.json`), then the token strings of
    /// `tokenizer_config.json`; the first source that gives one wins, field by field.
    pub fn from_dir(dir: &Path, from_config: &SpecialTokens) -> Result<Self> {
        let path = dir.join(TOKENIZER_FILE);
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            if path.is_file() {
                ModelError::Tokenizer {
                    path: path.clone(),
                    message: e.to_string(),
                }
            } else {
                ModelError::io(
                    &path,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
                )
            }
        })?;
        let mut special = read_generation_config(&dir.join("generation_config.json"))?
            .unwrap_or_default()
            .or(from_config);
        let from_strings = read_tokenizer_config(&dir.join("tokenizer_config.json"), &inner)?;
        special = special.or(&from_strings);
        Ok(Self {
            inner,
            path,
            special,
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Beginning, end and padding ids.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Whether `id` ends a generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.special.eos.contains(&id)
    }

    /// Token ids of `text`; `add_special` applies the tokenizer's post-processor
    /// (e.g. a leading BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| self.error(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special` leaves special tokens out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.error(e))
    }

    /// An incremental decoder for streaming: feed ids one at a time, get the text they
    /// complete (none while a multi-byte character is still partial).
    pub fn stream(&self, skip_special: bool) -> TextStream<'_> {
        TextStream {
            inner: self.inner.decode_stream(skip_special),
            path: &self.path,
        }
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn error(&self, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}

/// Incremental decoding of [`Tokenizer::stream`].
pub struct TextStream<'a> {
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
    path: &'a Path,
}

impl TextStream<'_> {
    /// Adds one id; returns the new text, if a complete piece is ready.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.inner.step(id).map_err(|e| ModelError::Tokenizer {
            path: self.path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

fn read_object(path: &Path) -> Result<Option<serde_json::Map<String, Value>>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(map)) => Ok(Some(map)),
        Ok(_) => Err(ModelError::Json {
            path: path.to_path_buf(),
            message: "the top level is not an object".into(),
        }),
        Err(e) => Err(ModelError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        }),
    }
}

/// Special ids of `generation_config.json`, when the file exists.
fn read_generation_config(path: &Path) -> Result<Option<SpecialTokens>> {
    let Some(map) = read_object(path)? else {
        return Ok(None);
    };
    SpecialTokens::parse(&Fields::new(&map, path)).map(Some)
}

/// Special ids named by token string in `tokenizer_config.json` (`bos_token`,
/// `eos_token`, `pad_token`: a string or an object with `content`).
fn read_tokenizer_config(path: &Path, tok: &tokenizers::Tokenizer) -> Result<SpecialTokens> {
    let Some(map) = read_object(path)? else {
        return Ok(SpecialTokens::default());
    };
    let id_of = |field: &str| -> Result<Option<u32>> {
        let token = match map.get(field) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => s.as_str(),
                _ => return Err(ModelError::invalid(path, field, "object without `content`")),
            },
            Some(v) => {
                return Err(ModelError::invalid(
                    path,
                    field,
                    format!("expected a token string, got {v}"),
                ))
            }
        };
        tok.token_to_id(token).map(Some).ok_or_else(|| {
            ModelError::invalid(path, field, format!("`{token}` is not in tokenizer.json"))
        })
    };
    Ok(SpecialTokens {
        bos: id_of("bos_token")?,
        eos: id_of("eos_token")?.into_iter().collect(),
        pad: id_of("pad_token")?,
    })
}
