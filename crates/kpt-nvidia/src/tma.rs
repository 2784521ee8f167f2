//! TMA tensor maps (`cuTensorMapEncodeTiled`) for the copies of the Hopper attention
//! kernel (`kernels/cuda/flash_attention_sm90.cu`, its `_tma_` entry points).

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

/// A `CUtensorMap`: 128 bytes the driver encodes, passed to a kernel by value (the
/// kernel's `TensorMap`, `alignas(64)`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMap([u64; 16]);

// SAFETY: 128 plain bytes with the layout and alignment of the kernel's parameter type.
unsafe impl DeviceRepr for TensorMap {}

/// The element type of a map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TmaElem {
    Bf16,
    F16,
    /// One byte (FP8 e4m3).
    Byte,
}

impl TmaElem {
    fn code(self) -> sys::CUtensorMapDataType {
        match self {
            TmaElem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            TmaElem::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TmaElem::Byte => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        }
    }
}

/// A 3-D map of the tensor at device address `ptr`: `dims` in elements, innermost first,
/// `strides` the byte distances between consecutive indices of dims 1 and 2, read in
/// boxes of `boxes` elements with the 128-byte swizzle and zeros outside the tensor.
/// `None` where the driver refuses the map (an address or stride not a multiple of 16
/// bytes, a dimension past its limits); callers then copy without TMA.
pub(crate) fn tensor_map_3d(
    elem: TmaElem,
    ptr: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    boxes: [u32; 3],
) -> Option<TensorMap> {
    if dims.contains(&0) {
        return None;
    }
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let ones = [1u32; 3];
    // SAFETY: every pointer points at a live array of the length the rank (3) implies
    // (`strides` holds rank - 1 values); the map is written, not read, by the call.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            elem.code(),
            3,
            ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        tracing::debug!("cuTensorMapEncodeTiled refused {dims:?} / {strides:?}: {rc:?}");
        return None;
    }
    // SAFETY: the driver wrote the map; both types are 16 u64 with alignment 64.
    let map = unsafe { map.assume_init() };
    Some(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_is_the_kernels_128_bytes_aligned_to_64() {
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
        assert_eq!(std::mem::size_of::<sys::CUtensorMap>(), 128);
    }
}
