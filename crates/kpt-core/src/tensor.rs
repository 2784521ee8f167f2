//! Host tensors: typed storage, shape, strides and views.
//!
//! A [`Tensor`] is a cheap handle (an `Arc` of [`Storage`]) plus a [`Layout`]
//! (shape, strides in elements, offset). Views such as [`Tensor::transpose`] and
//! [`Tensor::narrow`] share storage; [`Tensor::contiguous`] copies when needed.
//! Quantized tensors (FP8, int8) carry a per-tensor `scale`: value = stored * scale.

use std::sync::Arc;

use half::{bf16, f16};

use crate::dtype::{self, DType};
use crate::error::{KptError, Result};

/// Typed, contiguous element storage.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// 64-bit floats.
    F64(Vec<f64>),
    /// 32-bit floats.
    F32(Vec<f32>),
    /// IEEE half floats.
    F16(Vec<f16>),
    /// bfloat16 values.
    BF16(Vec<bf16>),
    /// FP8 E4M3 bit patterns.
    F8E4M3(Vec<u8>),
    /// FP8 E5M2 bit patterns.
    F8E5M2(Vec<u8>),
    /// int8 values.
    I8(Vec<i8>),
    /// int32 values.
    I32(Vec<i32>),
    /// int64 values.
    I64(Vec<i64>),
}

macro_rules! storage_dispatch {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            Storage::F64($v) => $body,
            Storage::F32($v) => $body,
            Storage::F16($v) => $body,
            Storage::BF16($v) => $body,
            Storage::F8E4M3($v) => $body,
            Storage::F8E5M2($v) => $body,
            Storage::I8($v) => $body,
            Storage::I32($v) => $body,
            Storage::I64($v) => $body,
        }
    };
}

/// Applies `$body` to the vector inside any variant and wraps the result in the same variant.
macro_rules! storage_map {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            Storage::F64($v) => Storage::F64($body),
            Storage::F32($v) => Storage::F32($body),
            Storage::F16($v) => Storage::F16($body),
            Storage::BF16($v) => Storage::BF16($body),
            Storage::F8E4M3($v) => Storage::F8E4M3($body),
            Storage::F8E5M2($v) => Storage::F8E5M2($body),
            Storage::I8($v) => Storage::I8($body),
            Storage::I32($v) => Storage::I32($body),
            Storage::I64($v) => Storage::I64($body),
        }
    };
}

impl Storage {
    /// Zero-filled storage of `len` elements.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F64 => Storage::F64(vec![0.0; len]),
            DType::F32 => Storage::F32(vec![0.0; len]),
            DType::F16 => Storage::F16(vec![f16::ZERO; len]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; len]),
            DType::F8E4M3 => Storage::F8E4M3(vec![0; len]),
            DType::F8E5M2 => Storage::F8E5M2(vec![0; len]),
            DType::I8 => Storage::I8(vec![0; len]),
            DType::I32 => Storage::I32(vec![0; len]),
            DType::I64 => Storage::I64(vec![0; len]),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::F64(_) => DType::F64,
            Storage::F32(_) => DType::F32,
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
            Storage::F8E4M3(_) => DType::F8E4M3,
            Storage::F8E5M2(_) => DType::F8E5M2,
            Storage::I8(_) => DType::I8,
            Storage::I32(_) => DType::I32,
            Storage::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        storage_dispatch!(self, v => v.len())
    }

    /// Whether the storage holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw bytes (little-endian, as in memory).
    pub fn as_bytes(&self) -> &[u8] {
        storage_dispatch!(self, v => bytemuck::cast_slice(v.as_slice()))
    }

    /// The raw bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        storage_dispatch!(self, v => bytemuck::cast_slice_mut(v.as_mut_slice()))
    }

    /// Builds storage from raw little-endian bytes; the length must be a multiple of the element size.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<Self> {
        let size = dtype.size_in_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(KptError::InvalidArgument(format!(
                "{} bytes is not a whole number of {dtype} elements ({size} bytes each)",
                bytes.len()
            )));
        }
        fn collect<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
            bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(bytemuck::pod_read_unaligned)
                .collect()
        }
        Ok(match dtype {
            DType::F64 => Storage::F64(collect(bytes)),
            DType::F32 => Storage::F32(collect(bytes)),
            DType::F16 => Storage::F16(collect(bytes)),
            DType::BF16 => Storage::BF16(collect(bytes)),
            DType::F8E4M3 => Storage::F8E4M3(bytes.to_vec()),
            DType::F8E5M2 => Storage::F8E5M2(bytes.to_vec()),
            DType::I8 => Storage::I8(collect(bytes)),
            DType::I32 => Storage::I32(collect(bytes)),
            DType::I64 => Storage::I64(collect(bytes)),
        })
    }

    /// Element `i` as f64 (quantized types unscaled: the stored value).
    /// Elements `range` as f64, one typed loop (no per-element dispatch).
    fn range_f64(&self, range: std::ops::Range<usize>) -> Vec<f64> {
        match self {
            Storage::F64(v) => v[range].to_vec(),
            Storage::F32(v) => v[range].iter().map(|&x| x as f64).collect(),
            Storage::F16(v) => v[range].iter().map(|x| x.to_f64()).collect(),
            Storage::BF16(v) => v[range].iter().map(|x| x.to_f64()).collect(),
            Storage::F8E4M3(v) => v[range]
                .iter()
                .map(|&x| dtype::f8e4m3_to_f32(x) as f64)
                .collect(),
            Storage::F8E5M2(v) => v[range]
                .iter()
                .map(|&x| dtype::f8e5m2_to_f32(x) as f64)
                .collect(),
            Storage::I8(v) => v[range].iter().map(|&x| x as f64).collect(),
            Storage::I32(v) => v[range].iter().map(|&x| x as f64).collect(),
            Storage::I64(v) => v[range].iter().map(|&x| x as f64).collect(),
        }
    }

    fn get_f64(&self, i: usize) -> f64 {
        match self {
            Storage::F64(v) => v[i],
            Storage::F32(v) => v[i] as f64,
            Storage::F16(v) => v[i].to_f64(),
            Storage::BF16(v) => v[i].to_f64(),
            Storage::F8E4M3(v) => dtype::f8e4m3_to_f32(v[i]) as f64,
            Storage::F8E5M2(v) => dtype::f8e5m2_to_f32(v[i]) as f64,
            Storage::I8(v) => v[i] as f64,
            Storage::I32(v) => v[i] as f64,
            Storage::I64(v) => v[i] as f64,
        }
    }

    /// Converts f64 values to `dtype` storage: round to nearest even, saturating
    /// for FP8/int8 after dividing by `scale`.
    pub fn from_f64(dtype: DType, values: &[f64], scale: f32) -> Self {
        let s = scale as f64;
        match dtype {
            DType::F64 => Storage::F64(values.to_vec()),
            DType::F32 => Storage::F32(values.iter().map(|&x| x as f32).collect()),
            DType::F16 => Storage::F16(values.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => Storage::BF16(values.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::F8E4M3 => Storage::F8E4M3(
                values
                    .iter()
                    .map(|&x| dtype::f32_to_f8e4m3((x / s) as f32))
                    .collect(),
            ),
            DType::F8E5M2 => Storage::F8E5M2(
                values
                    .iter()
                    .map(|&x| dtype::f32_to_f8e5m2((x / s) as f32))
                    .collect(),
            ),
            DType::I8 => Storage::I8(
                values
                    .iter()
                    .map(|&x| dtype::f32_to_i8((x / s) as f32))
                    .collect(),
            ),
            DType::I32 => Storage::I32(values.iter().map(|&x| x.round() as i32).collect()),
            DType::I64 => Storage::I64(values.iter().map(|&x| x.round() as i64).collect()),
        }
    }
}

/// A Rust element type that maps onto a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The matching dtype.
    const DTYPE: DType;
    /// Wraps a vector into storage.
    fn into_storage(v: Vec<Self>) -> Storage;
    /// Borrows the vector out of storage of the same dtype.
    fn slice(s: &Storage) -> Option<&[Self]>;
    /// Mutably borrows the vector out of storage of the same dtype.
    fn slice_mut(s: &mut Storage) -> Option<&mut [Self]>;
}

macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn into_storage(v: Vec<Self>) -> Storage {
                Storage::$d(v)
            }
            fn slice(s: &Storage) -> Option<&[Self]> {
                match s {
                    Storage::$d(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut Storage) -> Option<&mut [Self]> {
                match s {
                    Storage::$d(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f64, F64);
element!(f32, F32);
element!(f16, F16);
element!(bf16, BF16);
element!(i8, I8);
element!(i32, I32);
element!(i64, I64);

/// Shape, strides (in elements) and offset of a tensor view.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// Row-major contiguous layout for `shape`.
    pub fn contiguous(shape: &[usize]) -> Self {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1;
        for (s, &d) in strides.iter_mut().zip(shape).rev() {
            *s = acc;
            acc *= d;
        }
        Self {
            shape: shape.to_vec(),
            strides,
            offset: 0,
        }
    }

    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether elements are laid out row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// Storage indices of every element in row-major order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.numel();
        let mut idx = vec![0usize; self.shape.len()];
        let mut pos = self.offset;
        (0..n).map(move |i| {
            let current = pos;
            if i + 1 < n {
                for d in (0..idx.len()).rev() {
                    idx[d] += 1;
                    pos += self.strides[d];
                    if idx[d] < self.shape[d] {
                        break;
                    }
                    pos -= self.strides[d] * idx[d];
                    idx[d] = 0;
                }
            }
            current
        })
    }
}

/// A host tensor: shared typed storage plus a view layout.
#[derive(Debug, Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    layout: Layout,
    scale: f32,
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.shape() == other.shape()
            && self.dtype() == other.dtype()
            && self.scale == other.scale
            && self.to_f64_vec() == other.to_f64_vec()
    }
}

impl Tensor {
    /// A contiguous tensor from storage; the element count must match the shape.
    pub fn new(storage: Storage, shape: &[usize]) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if storage.len() != numel {
            return Err(KptError::shape(
                "Tensor::new",
                format!(
                    "shape {shape:?} needs {numel} elements, storage has {}",
                    storage.len()
                ),
            ));
        }
        Ok(Self {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape),
            scale: 1.0,
        })
    }

    /// A contiguous tensor from a vector of elements.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        Self::new(T::into_storage(data), shape)
    }

    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Self {
        Self {
            storage: Arc::new(Storage::zeros(dtype, shape.iter().product())),
            layout: Layout::contiguous(shape),
            scale: 1.0,
        }
    }

    /// Converts f64 values to a tensor of `dtype`. Quantized dtypes get a per-tensor
    /// scale chosen from the absolute maximum, so the values use the full range.
    pub fn from_f64(values: &[f64], shape: &[usize], dtype: DType) -> Result<Self> {
        let amax = values.iter().fold(0f64, |m, &x| m.max(x.abs())) as f32;
        let scale = dtype::quant_scale(amax, dtype);
        let mut t = Self::new(Storage::from_f64(dtype, values, scale), shape)?;
        t.scale = scale;
        Ok(t)
    }

    /// A tensor from raw bytes (e.g. a safetensors buffer).
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Self> {
        Self::new(Storage::from_bytes(dtype, bytes)?, shape)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }

    /// The view layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.layout.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Quantization scale (1.0 for non-quantized tensors).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Returns the tensor with a different scale (same stored values).
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    /// The underlying storage (whole, regardless of the view).
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Whether the view is row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The elements as a typed slice when the tensor is contiguous and of type `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let s = T::slice(&self.storage)
            .ok_or_else(|| KptError::dtype("Tensor::as_slice", T::DTYPE.name(), self.dtype()))?;
        if !self.is_contiguous() {
            return Err(KptError::InvalidArgument(
                "as_slice needs a contiguous tensor; call .contiguous() first".into(),
            ));
        }
        Ok(&s[self.layout.offset..self.layout.offset + self.numel()])
    }

    /// The stored bytes of a contiguous tensor.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        if !self.is_contiguous() {
            return Err(KptError::InvalidArgument(
                "as_bytes needs a contiguous tensor; call .contiguous() first".into(),
            ));
        }
        let size = self.dtype().size_in_bytes();
        let start = self.layout.offset * size;
        Ok(&self.storage.as_bytes()[start..start + self.numel() * size])
    }

    /// Every element as f64 in row-major order, dequantized (stored * scale).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let scale = self.scale as f64;
        let quantized = self.dtype().is_quantized();
        if self.is_contiguous() {
            let start = self.layout.offset;
            let mut v = self.storage.range_f64(start..start + self.numel());
            if quantized {
                v.iter_mut().for_each(|x| *x *= scale);
            }
            return v;
        }
        self.layout
            .indices()
            .map(|i| {
                let v = self.storage.get_f64(i);
                if quantized {
                    v * scale
                } else {
                    v
                }
            })
            .collect()
    }

    /// A contiguous copy (or a cheap clone when already contiguous from offset 0).
    pub fn contiguous(&self) -> Tensor {
        if self.is_contiguous() && self.layout.offset == 0 && self.storage.len() == self.numel() {
            return self.clone();
        }
        let storage = storage_map!(self.storage.as_ref(), v => {
            self.layout.indices().map(|i| v[i]).collect()
        });
        Self {
            storage: Arc::new(storage),
            layout: Layout::contiguous(self.shape()),
            scale: self.scale,
        }
    }

    /// Converts to another dtype (quantized targets get an amax-based scale).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        Self::from_f64(&self.to_f64_vec(), self.shape(), dtype)
    }

    /// Same data with a new shape; needs a contiguous tensor and an equal element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if numel != self.numel() {
            return Err(KptError::shape(
                "reshape",
                format!(
                    "cannot reshape {:?} ({} elements) to {shape:?} ({numel} elements)",
                    self.shape(),
                    self.numel()
                ),
            ));
        }
        let base = self.contiguous();
        let mut layout = Layout::contiguous(shape);
        layout.offset = base.layout.offset;
        Ok(Self {
            storage: base.storage,
            layout,
            scale: self.scale,
        })
    }

    /// A view with dimensions `a` and `b` swapped (no copy).
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor> {
        let rank = self.rank();
        if a >= rank || b >= rank {
            return Err(KptError::shape(
                "transpose",
                format!("dims ({a}, {b}) out of range for rank {rank}"),
            ));
        }
        let mut layout = self.layout.clone();
        layout.shape.swap(a, b);
        layout.strides.swap(a, b);
        Ok(Self {
            storage: self.storage.clone(),
            layout,
            scale: self.scale,
        })
    }

    /// A view of `len` entries of dimension `dim` starting at `start` (no copy).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let rank = self.rank();
        if dim >= rank {
            return Err(KptError::shape(
                "narrow",
                format!("dim {dim} out of range for rank {rank}"),
            ));
        }
        let size = self.shape()[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(KptError::shape(
                "narrow",
                format!("range {start}..{start}+{len} out of bounds for dim {dim} of size {size}"),
            ));
        }
        let mut layout = self.layout.clone();
        layout.offset += start * layout.strides[dim];
        layout.shape[dim] = len;
        Ok(Self {
            storage: self.storage.clone(),
            layout,
            scale: self.scale,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_and_contiguous() {
        let t = Tensor::from_vec((0..6).map(|x| x as f32).collect(), &[2, 3]).unwrap();
        let tt = t.transpose(0, 1).unwrap();
        assert_eq!(tt.shape(), &[3, 2]);
        assert!(!tt.is_contiguous());
        assert_eq!(tt.to_f64_vec(), vec![0., 3., 1., 4., 2., 5.]);
        let c = tt.contiguous();
        assert!(c.is_contiguous());
        assert_eq!(c.as_slice::<f32>().unwrap(), &[0., 3., 1., 4., 2., 5.]);
    }

    #[test]
    fn narrow_views() {
        let t = Tensor::from_vec((0..12).map(|x| x as i64).collect(), &[3, 4]).unwrap();
        let n = t.narrow(1, 1, 2).unwrap();
        assert_eq!(n.to_f64_vec(), vec![1., 2., 5., 6., 9., 10.]);
        let r = t.narrow(0, 1, 2).unwrap();
        assert!(r.is_contiguous());
        assert_eq!(r.as_slice::<i64>().unwrap(), &[4, 5, 6, 7, 8, 9, 10, 11]);
        assert!(matches!(t.narrow(1, 3, 2), Err(KptError::Shape { .. })));
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(matches!(
            Tensor::from_vec(vec![1f32; 5], &[2, 3]),
            Err(KptError::Shape { .. })
        ));
        let t = Tensor::zeros(DType::F32, &[2, 3]);
        assert!(t.reshape(&[4, 2]).is_err());
        assert!(t.transpose(0, 2).is_err());
        assert!(matches!(
            t.as_slice::<f16>(),
            Err(KptError::DTypeMismatch { .. })
        ));
        assert!(Storage::from_bytes(DType::F32, &[0u8; 7]).is_err());
    }

    #[test]
    fn quantized_round_trip_within_precision() {
        let values: Vec<f64> = (0..64).map(|i| (i as f64 - 31.5) * 0.37).collect();
        for dtype in [
            DType::F8E4M3,
            DType::F8E5M2,
            DType::I8,
            DType::BF16,
            DType::F16,
        ] {
            let t = Tensor::from_f64(&values, &[8, 8], dtype).unwrap();
            let amax = values.iter().fold(0f64, |m, x| m.max(x.abs()));
            let bound = if dtype == DType::I8 {
                t.scale() as f64 * 0.5
            } else {
                amax * dtype.epsilon()
            };
            for (a, b) in t.to_f64_vec().iter().zip(&values) {
                assert!((a - b).abs() <= bound * 1.0001, "{dtype}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn fp8_views_keep_their_dtype() {
        let t = Tensor::from_f64(&[1.0, -2.0, 3.0, 4.0], &[2, 2], DType::F8E5M2).unwrap();
        let c = t.transpose(0, 1).unwrap().contiguous();
        assert_eq!(c.dtype(), DType::F8E5M2);
        let v = t.to_f64_vec();
        assert_eq!(c.to_f64_vec(), vec![v[0], v[2], v[1], v[3]]);
        assert!((v[2] - 3.0).abs() < 0.25, "{v:?}");
    }

    #[test]
    fn bytes_round_trip() {
        let t = Tensor::from_vec(vec![bf16::from_f32(1.5), bf16::from_f32(-2.0)], &[2]).unwrap();
        let back = Tensor::from_bytes(t.as_bytes().unwrap(), DType::BF16, &[2]).unwrap();
        assert_eq!(back, t);
    }
}
