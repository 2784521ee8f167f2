//! Device buffers: host data in, results out.

use half::{bf16, f16};
use kpt_core::DType;

use crate::client::{Client, Device};
use crate::error::{PjrtError, Result};
use crate::plugin::args;
use crate::sys;

/// The PJRT element type of a kpt dtype.
pub fn element_type(dtype: DType) -> sys::PJRT_Buffer_Type {
    match dtype {
        DType::F64 => sys::PJRT_Buffer_Type_F64,
        DType::F32 => sys::PJRT_Buffer_Type_F32,
        DType::F16 => sys::PJRT_Buffer_Type_F16,
        DType::BF16 => sys::PJRT_Buffer_Type_BF16,
        DType::F8E4M3 => sys::PJRT_Buffer_Type_F8E4M3FN,
        DType::F8E5M2 => sys::PJRT_Buffer_Type_F8E5M2,
        DType::I8 => sys::PJRT_Buffer_Type_S8,
        DType::I32 => sys::PJRT_Buffer_Type_S32,
        DType::I64 => sys::PJRT_Buffer_Type_S64,
    }
}

/// The kpt dtype of a PJRT element type, if kpt has one.
pub fn dtype_of(ty: sys::PJRT_Buffer_Type) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| element_type(d) == ty)
}

/// Host element types that buffers are made from and read into.
pub trait HostElement: bytemuck::Pod {
    /// The matching kpt dtype.
    const DTYPE: DType;
}

macro_rules! host_element {
    ($($t:ty => $d:ident),*) => {$(
        impl HostElement for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}
host_element!(f64 => F64, f32 => F32, f16 => F16, bf16 => BF16, i8 => I8, i32 => I32, i64 => I64);

/// A buffer on a device of a [`Client`], freed on drop.
pub struct Buffer {
    client: Client,
    raw: *mut sys::PJRT_Buffer,
}

// SAFETY: a PJRT buffer may be used and freed from any thread (the C API is
// thread-safe); the handle keeps its client alive.
unsafe impl Send for Buffer {}
// SAFETY: as above; `&Buffer` only reads.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("dtype", &self.dtype().ok())
            .field("dims", &self.dims().ok())
            .finish()
    }
}

impl Client {
    /// Copies `data` (row-major, `dims`) to `device`.
    ///
    /// Errors: `data` does not hold `product(dims)` elements ([`PjrtError::Invalid`]).
    pub fn buffer<T: HostElement>(
        &self,
        data: &[T],
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        self.buffer_from_bytes(bytemuck::cast_slice(data), T::DTYPE, dims, device)
    }

    /// Copies `bytes` (row-major elements of `dtype`, `dims`) to `device`.
    pub fn buffer_from_bytes(
        &self,
        bytes: &[u8],
        dtype: DType,
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        let numel = dims.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
        });
        let want = numel.and_then(|n| n.checked_mul(dtype.size_in_bytes()));
        if want != Some(bytes.len()) {
            return Err(PjrtError::Invalid(format!(
                "buffer of {dtype} {dims:?} needs {} bytes, got {}",
                want.map_or("an impossible number of".into(), |w| w.to_string()),
                bytes.len()
            )));
        }
        let plugin = self.plugin();
        let mut a = args::<sys::PJRT_Client_BufferFromHostBuffer_Args>();
        a.client = self.raw();
        a.data = bytes.as_ptr().cast();
        a.type_ = element_type(dtype);
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        // The plugin copies the data before the call returns.
        a.host_buffer_semantics = sys::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        a.device = device.raw();
        plugin.call(
            "PJRT_Client_BufferFromHostBuffer",
            plugin.api().PJRT_Client_BufferFromHostBuffer,
            &mut a,
        )?;
        let buffer = Buffer {
            client: self.clone(),
            raw: a.buffer,
        };
        plugin.await_event("PJRT_Client_BufferFromHostBuffer", a.done_with_host_buffer)?;
        Ok(buffer)
    }
}

impl Buffer {
    /// Wraps a buffer the plugin returned (owned from now on).
    pub(crate) fn from_raw(client: &Client, raw: *mut sys::PJRT_Buffer) -> Self {
        Buffer {
            client: client.clone(),
            raw,
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Buffer {
        self.raw
    }

    /// The element dtype.
    ///
    /// Errors: an element type kpt has no dtype for ([`PjrtError::Invalid`]).
    pub fn dtype(&self) -> Result<DType> {
        let plugin = self.client.plugin();
        let mut a = args::<sys::PJRT_Buffer_ElementType_Args>();
        a.buffer = self.raw;
        plugin.call(
            "PJRT_Buffer_ElementType",
            plugin.api().PJRT_Buffer_ElementType,
            &mut a,
        )?;
        dtype_of(a.type_).ok_or_else(|| {
            PjrtError::Invalid(format!("PJRT element type {} has no kpt dtype", a.type_))
        })
    }

    /// The dimensions.
    pub fn dims(&self) -> Result<Vec<i64>> {
        let plugin = self.client.plugin();
        let mut a = args::<sys::PJRT_Buffer_Dimensions_Args>();
        a.buffer = self.raw;
        plugin.call(
            "PJRT_Buffer_Dimensions",
            plugin.api().PJRT_Buffer_Dimensions,
            &mut a,
        )?;
        if a.num_dims == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the dims are owned by the buffer and `num_dims` long.
        Ok(unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) }.to_vec())
    }

    /// Copies the buffer to the host as bytes (row-major).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let plugin = self.client.plugin();
        let api = plugin.api();
        // First the size, then the copy.
        let mut a = args::<sys::PJRT_Buffer_ToHostBuffer_Args>();
        a.src = self.raw;
        plugin.call(
            "PJRT_Buffer_ToHostBuffer",
            api.PJRT_Buffer_ToHostBuffer,
            &mut a,
        )?;
        let mut out = vec![0u8; a.dst_size];
        let mut b = args::<sys::PJRT_Buffer_ToHostBuffer_Args>();
        b.src = self.raw;
        b.dst = out.as_mut_ptr().cast();
        b.dst_size = out.len();
        plugin.call(
            "PJRT_Buffer_ToHostBuffer",
            api.PJRT_Buffer_ToHostBuffer,
            &mut b,
        )?;
        plugin.await_event("PJRT_Buffer_ToHostBuffer", b.event)?;
        Ok(out)
    }

    /// Copies the buffer to the host as elements of `T`.
    ///
    /// Errors: the buffer's dtype is not `T`'s ([`PjrtError::Invalid`]).
    pub fn to_vec<T: HostElement>(&self) -> Result<Vec<T>> {
        let dtype = self.dtype()?;
        if dtype != T::DTYPE {
            return Err(PjrtError::Invalid(format!(
                "buffer holds {dtype}, asked for {}",
                T::DTYPE
            )));
        }
        let bytes = self.to_bytes()?;
        let mut out = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        if dst.len() != bytes.len() {
            return Err(PjrtError::Invalid(format!(
                "{} bytes are not whole {dtype} elements",
                bytes.len()
            )));
        }
        dst.copy_from_slice(&bytes);
        Ok(out)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let plugin = self.client.plugin();
        let mut a = args::<sys::PJRT_Buffer_Destroy_Args>();
        a.buffer = self.raw;
        if let Err(e) = plugin.call(
            "PJRT_Buffer_Destroy",
            plugin.api().PJRT_Buffer_Destroy,
            &mut a,
        ) {
            tracing::warn!("{e}");
        }
    }
}
