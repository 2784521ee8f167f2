//! The raw HIP runtime interface kpt uses: function signatures, `hipError_t` and
//! `hipDeviceAttribute_t` values, and the two layouts of `hipDeviceProp_t`.
//!
//! Written from the headers, not generated: kpt calls a dozen functions, all of them with
//! integer, pointer or C-string arguments. Sources:
//!
//! - ROCm 5.2: `/usr/include/hip/hip_runtime_api.h` of Debian 12's `libamdhip64-dev`
//!   5.2.3-8 (`HIP_VERSION` 5.2.21153). Enum values and the `hipDeviceProp_t` offsets
//!   below were printed by a C program compiled against that header (gcc, x86-64).
//! - ROCm 6 and 7: `hip_runtime_api.h` of ROCm's `rocm-systems` repository
//!   (`projects/hip/include/hip/hip_runtime_api.h`), whose `hipDeviceProp_tR0600`
//!   offsets were computed the same way from a copy of its field list.
//!
//! The `hipDeviceAttribute_t` values kpt reads are the same in both (ROCm 6 renamed the
//! attributes it retired to `hipDeviceAttributeUnusedN` in place, so the numbering of
//! the others did not move). `hipDeviceProp_t` did change: ROCm 6.0 reordered and grew it
//! and renamed the function that fills it to `hipGetDevicePropertiesR0600`, keeping the
//! old layout behind `hipGetDevicePropertiesR0000`. A ROCm 5 runtime exports only
//! `hipGetDeviceProperties` with the old layout. See [`PropsLayout`].

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `hipError_t`.
pub type HipError = c_int;
/// `hipSuccess`.
pub const HIP_SUCCESS: HipError = 0;
/// `hipErrorNoDevice`: the runtime sees no GPU.
pub const HIP_ERROR_NO_DEVICE: HipError = 100;
/// `hipErrorOutOfMemory`.
pub const HIP_ERROR_OUT_OF_MEMORY: HipError = 2;
/// `hipErrorInvalidDevice`. ROCm 5.2's `hipInit` returns it on a machine without a GPU
/// or `/dev/kfd` (seen on kpt's CI machine with Debian's libamdhip64 5.2.3 installed).
pub const HIP_ERROR_INVALID_DEVICE: HipError = 101;
/// `hipErrorInsufficientDriver`: no usable kernel driver (`/dev/kfd`).
pub const HIP_ERROR_INSUFFICIENT_DRIVER: HipError = 35;

/// `hipError_t hipInit(unsigned int flags)`.
pub type HipInit = unsafe extern "C" fn(flags: c_uint) -> HipError;
/// `hipError_t hipGetDeviceCount(int* count)`.
pub type HipGetDeviceCount = unsafe extern "C" fn(count: *mut c_int) -> HipError;
/// `hipError_t hipDeviceGetName(char* name, int len, hipDevice_t device)`.
pub type HipDeviceGetName =
    unsafe extern "C" fn(name: *mut c_char, len: c_int, device: c_int) -> HipError;
/// `hipError_t hipDeviceTotalMem(size_t* bytes, hipDevice_t device)`.
pub type HipDeviceTotalMem = unsafe extern "C" fn(bytes: *mut usize, device: c_int) -> HipError;
/// `hipError_t hipDeviceGetAttribute(int* pi, hipDeviceAttribute_t attr, int deviceId)`.
pub type HipDeviceGetAttribute =
    unsafe extern "C" fn(value: *mut c_int, attr: c_int, device: c_int) -> HipError;
/// `hipError_t hipRuntimeGetVersion(int* runtimeVersion)` and `hipDriverGetVersion`.
pub type HipGetVersion = unsafe extern "C" fn(version: *mut c_int) -> HipError;
/// `const char* hipGetErrorName(hipError_t)` and `hipGetErrorString`.
pub type HipErrorText = unsafe extern "C" fn(error: HipError) -> *const c_char;
/// `hipError_t hipGetDevicePropertiesR0600(hipDeviceProp_tR0600* prop, int deviceId)`,
/// and the ROCm 5 `hipGetDeviceProperties` with the `R0000` struct.
pub type HipGetDeviceProperties =
    unsafe extern "C" fn(props: *mut c_void, device: c_int) -> HipError;

/// `hipStream_t`, `hipModule_t`, `hipFunction_t`: opaque handles.
pub type HipHandle = *mut c_void;
/// `hipError_t hipSetDevice(int deviceId)`.
pub type HipSetDevice = unsafe extern "C" fn(device: c_int) -> HipError;
/// `hipError_t hipMalloc(void** ptr, size_t size)`.
pub type HipMalloc = unsafe extern "C" fn(ptr: *mut *mut c_void, bytes: usize) -> HipError;
/// `hipError_t hipFree(void* ptr)`.
pub type HipFree = unsafe extern "C" fn(ptr: *mut c_void) -> HipError;
/// `hipError_t hipMemGetInfo(size_t* free, size_t* total)`.
pub type HipMemGetInfo = unsafe extern "C" fn(free: *mut usize, total: *mut usize) -> HipError;
/// `hipError_t hipStreamCreate(hipStream_t* stream)`.
pub type HipStreamCreate = unsafe extern "C" fn(stream: *mut HipHandle) -> HipError;
/// `hipError_t hipStreamSynchronize(hipStream_t)`, `hipStreamDestroy`, `hipModuleUnload`.
pub type HipHandleOp = unsafe extern "C" fn(handle: HipHandle) -> HipError;
/// `hipError_t hipMemcpyAsync(void* dst, const void* src, size_t sizeBytes,
/// hipMemcpyKind kind, hipStream_t stream)`.
pub type HipMemcpyAsync = unsafe extern "C" fn(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: c_int,
    stream: HipHandle,
) -> HipError;
/// `hipError_t hipMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
/// size_t width, size_t height, hipMemcpyKind kind, hipStream_t stream)`.
pub type HipMemcpy2DAsync = unsafe extern "C" fn(
    dst: *mut c_void,
    dpitch: usize,
    src: *const c_void,
    spitch: usize,
    width: usize,
    height: usize,
    kind: c_int,
    stream: HipHandle,
) -> HipError;
/// `hipError_t hipMemsetAsync(void* dst, int value, size_t sizeBytes, hipStream_t stream)`.
pub type HipMemsetAsync = unsafe extern "C" fn(
    dst: *mut c_void,
    value: c_int,
    bytes: usize,
    stream: HipHandle,
) -> HipError;
/// `hipMemcpyDeviceToDevice`.
pub const HIP_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `hipMemcpyHostToDevice`.
pub const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// `hipMemcpyDeviceToHost`.
pub const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// `hipError_t hipModuleLoadData(hipModule_t* module, const void* image)`.
pub type HipModuleLoadData =
    unsafe extern "C" fn(module: *mut HipHandle, image: *const c_void) -> HipError;
/// `hipError_t hipModuleGetFunction(hipFunction_t* function, hipModule_t module,
/// const char* kname)`.
pub type HipModuleGetFunction = unsafe extern "C" fn(
    function: *mut HipHandle,
    module: HipHandle,
    name: *const c_char,
) -> HipError;
/// `hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned gridDimX, gridDimY,
/// gridDimZ, blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes, hipStream_t
/// stream, void** kernelParams, void** extra)`.
pub type HipModuleLaunchKernel = unsafe extern "C" fn(
    function: HipHandle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_bytes: c_uint,
    stream: HipHandle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> HipError;

/// The `hipDeviceAttribute_t` values kpt reads (identical in ROCm 5.2 and 7.x headers).
pub mod attr {
    use std::ffi::c_int;

    /// Peak clock frequency in kHz.
    pub const CLOCK_RATE: c_int = 5;
    /// Integrated (APU) rather than discrete.
    pub const INTEGRATED: c_int = 16;
    /// L2 cache in bytes.
    pub const L2_CACHE_SIZE: c_int = 19;
    /// Maximum threads per block.
    pub const MAX_THREADS_PER_BLOCK: c_int = 56;
    /// Maximum resident threads per compute unit.
    pub const MAX_THREADS_PER_MULTIPROCESSOR: c_int = 57;
    /// Memory bus width in bits.
    pub const MEMORY_BUS_WIDTH: c_int = 59;
    /// Peak memory clock in kHz.
    pub const MEMORY_CLOCK_RATE: c_int = 60;
    /// Compute units.
    pub const MULTIPROCESSOR_COUNT: c_int = 63;
    /// PCI bus.
    pub const PCI_BUS_ID: c_int = 67;
    /// PCI device.
    pub const PCI_DEVICE_ID: c_int = 68;
    /// PCI domain.
    pub const PCI_DOMAIN_ID: c_int = 69;
    /// Shared memory (LDS) per block in bytes.
    pub const MAX_SHARED_MEMORY_PER_BLOCK: c_int = 74;
    /// Wavefront size.
    pub const WARP_SIZE: c_int = 87;
    /// LDS per compute unit in bytes (AMD-specific range).
    pub const MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: c_int = 10002;
}

/// A layout of `hipDeviceProp_t`. kpt reads two fields by offset and checks the layout
/// with a third: `name` (offset 0 in both) must equal `hipDeviceGetName` and
/// `totalGlobalMem` must equal `hipDeviceTotalMem`, so a runtime whose struct differs
/// from the one assumed fails with [`crate::AmdError::PropertiesLayout`] instead of
/// reporting a wrong architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PropsLayout {
    /// ROCm 5.x (`hipGetDeviceProperties`; `hipGetDevicePropertiesR0000` in ROCm 6+).
    R0000,
    /// ROCm 6.0 and later (`hipGetDevicePropertiesR0600`).
    R0600,
}

impl PropsLayout {
    /// The name of the layout, as HIP's symbol suffix writes it.
    pub const fn name(self) -> &'static str {
        match self {
            PropsLayout::R0000 => "R0000",
            PropsLayout::R0600 => "R0600",
        }
    }

    /// `sizeof(hipDeviceProp_t)`: 792 bytes (5.2) and 1472 bytes (R0600).
    pub const fn size(self) -> usize {
        match self {
            PropsLayout::R0000 => 792,
            PropsLayout::R0600 => 1472,
        }
    }

    /// `offsetof(hipDeviceProp_t, totalGlobalMem)`: after `name[256]` in 5.2; after
    /// `name[256]`, `uuid[16]`, `luid[8]` and `luidDeviceNodeMask` (padded) in R0600.
    pub const fn total_global_mem_offset(self) -> usize {
        match self {
            PropsLayout::R0000 => 256,
            PropsLayout::R0600 => 288,
        }
    }

    /// `offsetof(hipDeviceProp_t, gcnArchName)` (a `char[256]`).
    pub const fn gcn_arch_name_offset(self) -> usize {
        match self {
            PropsLayout::R0000 => 396,
            PropsLayout::R0600 => 1160,
        }
    }

    /// The exported function that fills this layout.
    pub const fn symbol(self) -> &'static str {
        match self {
            PropsLayout::R0000 => "hipGetDeviceProperties",
            PropsLayout::R0600 => "hipGetDevicePropertiesR0600",
        }
    }
}

/// Bytes kpt lends `hipGetDeviceProperties*`: more than either layout needs, so that a
/// runtime writing a larger struct than its header said cannot write past the buffer.
pub const PROPS_BUFFER: usize = 4096;

/// The NUL-terminated string of at most `max` bytes at `offset` of `buf` (lossy UTF-8).
pub fn c_string_at(buf: &[u8], offset: usize, max: usize) -> String {
    let end = (offset + max).min(buf.len());
    let field = buf.get(offset..end).unwrap_or_default();
    let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..len]).into_owned()
}

/// The native-endian `size_t` at `offset` of `buf`, if it is inside.
pub fn usize_at(buf: &[u8], offset: usize) -> Option<usize> {
    let bytes = buf.get(offset..offset + std::mem::size_of::<usize>())?;
    Some(usize::from_ne_bytes(bytes.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_fit_the_buffer_and_keep_fields_apart() {
        for layout in [PropsLayout::R0000, PropsLayout::R0600] {
            assert!(layout.size() <= PROPS_BUFFER);
            // gcnArchName[256] lies inside the struct, after totalGlobalMem.
            assert!(layout.gcn_arch_name_offset() + 256 <= layout.size());
            assert!(layout.total_global_mem_offset() + 8 <= layout.gcn_arch_name_offset());
            assert_eq!(layout.total_global_mem_offset() % 8, 0);
        }
        assert_ne!(
            PropsLayout::R0000.gcn_arch_name_offset(),
            PropsLayout::R0600.gcn_arch_name_offset()
        );
    }

    #[test]
    fn fields_are_read_by_offset() {
        let mut buf = vec![0u8; 64];
        buf[8..14].copy_from_slice(b"gfx90a");
        assert_eq!(c_string_at(&buf, 8, 32), "gfx90a");
        // No terminator within `max`: the field is cut at `max`.
        buf[8..40].fill(b'x');
        assert_eq!(c_string_at(&buf, 8, 4), "xxxx");
        assert_eq!(c_string_at(&buf, 100, 4), "");
        buf[16..24].copy_from_slice(&68_702_699_520usize.to_ne_bytes());
        assert_eq!(usize_at(&buf, 16), Some(68_702_699_520));
        assert_eq!(usize_at(&buf, 60), None);
    }
}
