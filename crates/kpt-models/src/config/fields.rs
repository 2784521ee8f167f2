//! Typed reads of JSON fields with errors naming the file and the field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// Typed access to the fields of one JSON object, with errors naming file and field.
pub(crate) struct Fields<'a> {
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) path: &'a Path,
    pub(crate) prefix: &'static str,
}

impl<'a> Fields<'a> {
    /// The fields of a top-level object.
    pub(crate) fn new(map: &'a Map<String, Value>, path: &'a Path) -> Self {
        Self {
            map,
            path,
            prefix: "",
        }
    }

    pub(crate) fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    pub(crate) fn invalid(&self, field: &str, message: impl Into<String>) -> ModelError {
        ModelError::invalid(self.path, &self.name(field), message)
    }

    pub(crate) fn missing(&self, field: &str) -> ModelError {
        ModelError::MissingField {
            path: PathBuf::from(self.path),
            field: self.name(field),
        }
    }

    /// The value, `None` when absent or null.
    pub(crate) fn get(&self, field: &str) -> Option<&'a Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_str(&self, field: &str) -> Result<Option<String>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.invalid(field, format!("expected a string, got {v}"))),
        }
    }

    pub(crate) fn req_str(&self, field: &str) -> Result<String> {
        self.opt_str(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.invalid(field, format!("expected a non-negative integer, got {v}"))
                }),
        }
    }

    pub(crate) fn req_usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_u32(&self, field: &str) -> Result<Option<u32>> {
        match self.opt_usize(field)? {
            None => Ok(None),
            Some(x) => u32::try_from(x)
                .map(Some)
                .map_err(|_| self.invalid(field, format!("{x} does not fit a token id"))),
        }
    }

    /// An id or a list of ids; empty when absent.
    pub(crate) fn u32_or_list(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.invalid(field, format!("{v} is not a token id")))
                })
                .collect(),
            Some(_) => Ok(self.opt_u32(field)?.into_iter().collect()),
        }
    }

    pub(crate) fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.invalid(field, format!("expected a number, got {v}"))),
        }
    }

    pub(crate) fn req_f64(&self, field: &str) -> Result<f64> {
        self.opt_f64(field)?.ok_or_else(|| self.missing(field))
    }

    pub(crate) fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.invalid(field, format!("expected true or false, got {v}"))),
        }
    }

    pub(crate) fn positive(&self, field: &str, v: usize) -> Result<()> {
        if v == 0 {
            Err(self.invalid(field, "must be at least 1"))
        } else {
            Ok(())
        }
    }

    /// Checks that `part` (a count of pieces) is non-zero and divides `whole`.
    pub(crate) fn divides(
        &self,
        part_name: &str,
        part: usize,
        whole_name: &str,
        whole: usize,
    ) -> Result<()> {
        if part == 0 || !whole.is_multiple_of(part) {
            return Err(self.invalid(
                part_name,
                format!("{part} does not divide {whole_name} = {whole}"),
            ));
        }
        Ok(())
    }
}
