//! AMDGPU code objects (HSACO): the ELF files `hipModuleLoadData` takes. [`CodeObject`]
//! reads what kpt checks before it would load one: the machine (`EM_AMDGPU`), the HSA
//! OS/ABI and code object version, the processor encoded in `e_flags`, the kernel
//! symbols (`name`, a function, and `name.kd`, its kernel descriptor), and the kernels'
//! metadata, a MessagePack map in the `NT_AMDGPU_METADATA` note (`amdhsa.kernels` with
//! register counts, LDS size, wave size, ...).
//!
//! Formats: LLVM's `AMDGPUUsage` ("ELF Code Object", "Code Object V4 Metadata");
//! `EF_AMDGPU_MACH_*` values from LLVM's `llvm/BinaryFormat/ELF.h`.

use object::elf;
use object::read::elf::{FileHeader, SectionHeader, Sym};
use object::Endianness;
use serde::Deserialize;

use crate::AmdError;

/// `ELFOSABI_AMDGPU_HSA`.
const ELFOSABI_AMDGPU_HSA: u8 = 64;
/// `NT_AMDGPU_METADATA` (code object v3 and later), in a note named `AMDGPU`.
const NT_AMDGPU_METADATA: u32 = 32;
/// `EF_AMDGPU_MACH`: the processor field of `e_flags`.
const EF_AMDGPU_MACH: u32 = 0xff;
/// `EF_AMDGPU_FEATURE_XNACK_V4` and `EF_AMDGPU_FEATURE_SRAMECC_V4` masks.
const EF_XNACK_V4: u32 = 0x300;
const EF_SRAMECC_V4: u32 = 0xc00;

/// `EF_AMDGPU_MACH_AMDGCN_*` values and their processors (GCN 5 and newer).
const MACHS: &[(u32, &str)] = &[
    (0x02c, "gfx900"),
    (0x02d, "gfx902"),
    (0x02e, "gfx904"),
    (0x02f, "gfx906"),
    (0x030, "gfx908"),
    (0x031, "gfx909"),
    (0x032, "gfx90c"),
    (0x033, "gfx1010"),
    (0x034, "gfx1011"),
    (0x035, "gfx1012"),
    (0x036, "gfx1030"),
    (0x037, "gfx1031"),
    (0x038, "gfx1032"),
    (0x039, "gfx1033"),
    (0x03d, "gfx1035"),
    (0x03e, "gfx1034"),
    (0x03f, "gfx90a"),
    (0x040, "gfx940"),
    (0x041, "gfx1100"),
    (0x042, "gfx1013"),
    (0x043, "gfx1150"),
    (0x044, "gfx1103"),
    (0x045, "gfx1036"),
    (0x046, "gfx1101"),
    (0x047, "gfx1102"),
    (0x048, "gfx1200"),
    (0x04a, "gfx1151"),
    (0x04b, "gfx941"),
    (0x04c, "gfx942"),
    (0x04e, "gfx1201"),
    (0x04f, "gfx950"),
];

/// The processor of an `EF_AMDGPU_MACH` value, if kpt's table has it.
pub fn processor_of_mach(mach: u32) -> Option<&'static str> {
    MACHS.iter().find(|&&(m, _)| m == mach).map(|&(_, p)| p)
}

/// A code object target feature's setting in `e_flags` (code object v4 and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureFlag {
    /// The processor does not have the feature.
    Unsupported,
    /// Built to run with the feature on or off.
    Any,
    /// Built for the feature off.
    Off,
    /// Built for the feature on.
    On,
}

impl FeatureFlag {
    fn from_bits(bits: u32) -> FeatureFlag {
        match bits {
            0 => FeatureFlag::Unsupported,
            1 => FeatureFlag::Any,
            2 => FeatureFlag::Off,
            _ => FeatureFlag::On,
        }
    }
}

/// One kernel's entry of `amdhsa.kernels`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct KernelMetadata {
    /// Source name.
    #[serde(rename = ".name")]
    pub name: String,
    /// Symbol of the kernel descriptor (`name.kd`).
    #[serde(rename = ".symbol")]
    pub symbol: String,
    /// Scalar registers used.
    #[serde(rename = ".sgpr_count")]
    pub sgpr_count: u32,
    /// Vector registers used (architected VGPRs on gfx90a and later).
    #[serde(rename = ".vgpr_count")]
    pub vgpr_count: u32,
    /// Accumulation registers used (gfx908 and later; absent elsewhere).
    #[serde(rename = ".agpr_count", default)]
    pub agpr_count: Option<u32>,
    /// Scalar registers spilled.
    #[serde(rename = ".sgpr_spill_count", default)]
    pub sgpr_spill_count: u32,
    /// Vector registers spilled.
    #[serde(rename = ".vgpr_spill_count", default)]
    pub vgpr_spill_count: u32,
    /// Static LDS in bytes.
    #[serde(rename = ".group_segment_fixed_size")]
    pub group_segment_fixed_size: u32,
    /// Scratch per work item in bytes.
    #[serde(rename = ".private_segment_fixed_size")]
    pub private_segment_fixed_size: u32,
    /// Kernel argument bytes.
    #[serde(rename = ".kernarg_segment_size")]
    pub kernarg_segment_size: u32,
    /// Threads per wavefront the kernel was compiled for.
    #[serde(rename = ".wavefront_size")]
    pub wavefront_size: u32,
    /// Largest workgroup the kernel may be launched with (`__launch_bounds__`).
    #[serde(rename = ".max_flat_workgroup_size")]
    pub max_flat_workgroup_size: u32,
    /// The kernel's arguments in order: the source's explicit ones, then the hidden ones
    /// the compiler appends (`hidden_block_count_x`, ...), which the runtime fills.
    #[serde(rename = ".args", default)]
    pub args: Vec<KernelArgMetadata>,
}

/// One entry of a kernel's `.args`: where an argument sits in the kernel argument
/// segment. `hipModuleLaunchKernel` copies each value the caller points to into
/// `offset..offset + size`, so the explicit arguments are the layout a launcher must
/// match.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct KernelArgMetadata {
    /// The source's parameter name, when the compiler recorded it.
    #[serde(rename = ".name", default)]
    pub name: Option<String>,
    /// Byte offset in the kernel argument segment.
    #[serde(rename = ".offset")]
    pub offset: u32,
    /// Size in bytes.
    #[serde(rename = ".size")]
    pub size: u32,
    /// `by_value`, `global_buffer`, `hidden_*`, ...
    #[serde(rename = ".value_kind")]
    pub value_kind: String,
}

impl KernelArgMetadata {
    /// Whether the compiler added this argument (the runtime fills it, the caller does
    /// not pass it).
    pub fn is_hidden(&self) -> bool {
        self.value_kind.starts_with("hidden_")
    }
}

impl KernelMetadata {
    /// The arguments a launcher passes: `(offset, size)` of each non-hidden one.
    pub fn explicit_args(&self) -> Vec<(u32, u32)> {
        self.args
            .iter()
            .filter(|a| !a.is_hidden())
            .map(|a| (a.offset, a.size))
            .collect()
    }
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(rename = "amdhsa.version")]
    version: Vec<u32>,
    #[serde(rename = "amdhsa.target", default)]
    target: Option<String>,
    #[serde(rename = "amdhsa.kernels")]
    kernels: Vec<KernelMetadata>,
}

/// A parsed AMDGPU code object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodeObject {
    /// The processor `e_flags` encodes, e.g. `gfx90a`.
    pub processor: &'static str,
    /// The raw `EF_AMDGPU_MACH` value.
    pub mach: u32,
    /// `xnack` as built.
    pub xnack: FeatureFlag,
    /// `sramecc` as built.
    pub sramecc: FeatureFlag,
    /// Code object version (4 for `EI_ABIVERSION` 2, 5 for 3, 6 for 4).
    pub code_object_version: u8,
    /// `amdhsa.version` of the metadata (`[1, 1]` for code object v4).
    pub metadata_version: Vec<u32>,
    /// `amdhsa.target`, e.g. `amdgcn-amd-amdhsa--gfx90a` (code object v4 and later).
    pub target: Option<String>,
    /// Names of the defined symbols.
    pub symbols: Vec<String>,
    /// The kernels' metadata.
    pub kernels: Vec<KernelMetadata>,
}

fn bad(reason: impl Into<String>) -> AmdError {
    AmdError::CodeObject(reason.into())
}

impl CodeObject {
    /// Parses `bytes`: a 64-bit little-endian ELF for `EM_AMDGPU` with the HSA OS/ABI,
    /// a processor kpt knows, its symbols and its metadata note.
    pub fn parse(bytes: &[u8]) -> Result<CodeObject, AmdError> {
        let elf_err = |what: &str, e: object::Error| bad(format!("{what}: {e}"));
        let header = elf::FileHeader64::<Endianness>::parse(bytes)
            .map_err(|e| elf_err("not a 64-bit ELF file", e))?;
        let endian = header.endian().map_err(|e| elf_err("ELF byte order", e))?;
        if header.e_machine(endian) != elf::EM_AMDGPU {
            return Err(bad(format!(
                "machine {} is not EM_AMDGPU ({})",
                header.e_machine(endian),
                elf::EM_AMDGPU
            )));
        }
        let ident = header.e_ident();
        if ident.os_abi.0 != ELFOSABI_AMDGPU_HSA {
            return Err(bad(format!(
                "OS/ABI {} is not ELFOSABI_AMDGPU_HSA ({ELFOSABI_AMDGPU_HSA})",
                ident.os_abi.0
            )));
        }
        let code_object_version = match ident.abi_version {
            2 => 4,
            3 => 5,
            4 => 6,
            v => {
                return Err(bad(format!(
                    "ABI version {v} is not code object v4, v5 or v6"
                )))
            }
        };
        let flags = header.e_flags(endian).0;
        let mach = flags & EF_AMDGPU_MACH;
        let processor = processor_of_mach(mach)
            .ok_or_else(|| bad(format!("EF_AMDGPU_MACH {mach:#x} is not a known processor")))?;
        let sections = header
            .sections(endian, bytes)
            .map_err(|e| elf_err("section headers", e))?;
        let mut metadata = None;
        for section in sections.iter() {
            let Some(mut notes) = section
                .notes(endian, bytes)
                .map_err(|e| elf_err("note section", e))?
            else {
                continue;
            };
            while let Some(note) = notes.next().map_err(|e| elf_err("note", e))? {
                if note.name() == b"AMDGPU" && note.n_type(endian).0 == NT_AMDGPU_METADATA {
                    let m: Metadata = rmp_serde::from_slice(note.desc())
                        .map_err(|e| bad(format!("AMDGPU metadata note: {e}")))?;
                    metadata = Some(m);
                }
            }
        }
        let metadata = metadata.ok_or_else(|| bad("no NT_AMDGPU_METADATA note"))?;
        let mut symbols = Vec::new();
        for kind in [elf::SHT_SYMTAB, elf::SHT_DYNSYM] {
            let table = sections
                .symbols(endian, bytes, kind)
                .map_err(|e| elf_err("symbol table", e))?;
            for sym in table.iter() {
                if sym.st_shndx(endian) == elf::SHN_UNDEF {
                    continue;
                }
                let name = sym
                    .name(endian, table.strings())
                    .map_err(|e| elf_err("symbol name", e))?;
                if !name.is_empty() {
                    symbols.push(String::from_utf8_lossy(name).into_owned());
                }
            }
        }
        symbols.sort();
        symbols.dedup();
        Ok(CodeObject {
            processor,
            mach,
            xnack: FeatureFlag::from_bits((flags & EF_XNACK_V4) >> 8),
            sramecc: FeatureFlag::from_bits((flags & EF_SRAMECC_V4) >> 10),
            code_object_version,
            metadata_version: metadata.version,
            target: metadata.target,
            symbols,
            kernels: metadata.kernels,
        })
    }

    /// Whether `name` is a defined symbol.
    pub fn has_symbol(&self, name: &str) -> bool {
        self.symbols
            .binary_search_by(|s| s.as_str().cmp(name))
            .is_ok()
    }

    /// The metadata of kernel `name`.
    pub fn kernel(&self, name: &str) -> Option<&KernelMetadata> {
        self.kernels.iter().find(|k| k.name == name)
    }

    /// Checks that this code object is one kpt can launch `entry_points` (name, threads
    /// per block, dynamic LDS bytes) from on `processor`: built for that processor (also
    /// in `amdhsa.target`), each entry point present as function and kernel descriptor
    /// with metadata, at most `lds_limit` bytes of static and dynamic LDS together
    /// (Triton asks for its LDS at launch), at most 512 VGPRs (256
    /// architected + 256 AGPRs on CDNA), at most 112 SGPRs, the wave size `wave_size`,
    /// no scratch and no VGPR spills, and a `max_flat_workgroup_size` that admits the
    /// block. SGPR spills are allowed: without scratch they go to VGPR lanes
    /// (`v_writelane`), not to memory. Returns every problem found.
    pub fn check(
        &self,
        processor: &str,
        wave_size: u32,
        lds_limit: u32,
        entry_points: &[(&str, u32, u32)],
    ) -> Result<(), AmdError> {
        let mut problems = Vec::new();
        if self.processor != processor {
            problems.push(format!(
                "built for {} (e_flags), not {processor}",
                self.processor
            ));
        }
        if let Some(t) = &self.target {
            let isa = t.strip_prefix("amdgcn-amd-amdhsa--").unwrap_or(t);
            if isa.split(':').next() != Some(processor) {
                problems.push(format!("amdhsa.target is {t}, not {processor}"));
            }
        }
        for &(name, block, dynamic_lds) in entry_points {
            let kd = format!("{name}.kd");
            if !self.has_symbol(name) {
                problems.push(format!("no symbol {name}"));
            }
            if !self.has_symbol(&kd) {
                problems.push(format!("no kernel descriptor {kd}"));
            }
            let Some(k) = self.kernel(name) else {
                problems.push(format!("no metadata for {name}"));
                continue;
            };
            if k.symbol != kd {
                problems.push(format!("{name}: metadata symbol {} is not {kd}", k.symbol));
            }
            let vgprs = k.vgpr_count + k.agpr_count.unwrap_or(0);
            if vgprs == 0 || vgprs > 512 {
                problems.push(format!("{name}: {vgprs} VGPRs + AGPRs (1..=512)"));
            }
            if k.sgpr_count == 0 || k.sgpr_count > 112 {
                problems.push(format!("{name}: {} SGPRs (1..=112)", k.sgpr_count));
            }
            let lds = u64::from(k.group_segment_fixed_size) + u64::from(dynamic_lds);
            if lds > u64::from(lds_limit) {
                problems.push(format!(
                    "{name}: {} bytes of static and {dynamic_lds} of dynamic LDS, more than \
                     {lds_limit}",
                    k.group_segment_fixed_size
                ));
            }
            if k.wavefront_size != wave_size {
                problems.push(format!(
                    "{name}: wave size {}, not {wave_size}",
                    k.wavefront_size
                ));
            }
            if k.private_segment_fixed_size != 0 {
                problems.push(format!(
                    "{name}: {} bytes of scratch per thread",
                    k.private_segment_fixed_size
                ));
            }
            if k.vgpr_spill_count != 0 {
                problems.push(format!(
                    "{name}: spills {} VGPRs to scratch",
                    k.vgpr_spill_count
                ));
            }
            if block > k.max_flat_workgroup_size {
                problems.push(format!(
                    "{name}: launched with {block} threads, built for at most {}",
                    k.max_flat_workgroup_size
                ));
            }
            if k.kernarg_segment_size == 0 {
                problems.push(format!("{name}: no kernel arguments"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(bad(problems.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mach_values_name_their_processors() {
        assert_eq!(processor_of_mach(0x3f), Some("gfx90a"));
        assert_eq!(processor_of_mach(0x40), Some("gfx940"));
        assert_eq!(processor_of_mach(0x4c), Some("gfx942"));
        assert_eq!(processor_of_mach(0x41), Some("gfx1100"));
        assert_eq!(processor_of_mach(0x36), Some("gfx1030"));
        assert_eq!(processor_of_mach(0x00), None);
        // One processor per value and one value per processor.
        for (i, (m, p)) in MACHS.iter().enumerate() {
            for (m2, p2) in &MACHS[i + 1..] {
                assert!(m != m2 && p != p2, "{p} / {p2}");
            }
        }
        assert_eq!(FeatureFlag::from_bits(1), FeatureFlag::Any);
        assert_eq!(FeatureFlag::from_bits(3), FeatureFlag::On);
    }

    #[test]
    fn non_amdgpu_files_are_rejected() {
        let err = CodeObject::parse(b"not an elf").unwrap_err();
        assert!(err.to_string().contains("not a 64-bit ELF"), "{err}");
        // This test executable is an ELF for the host, not for EM_AMDGPU.
        let host = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        if host.starts_with(b"\x7fELF") {
            let err = CodeObject::parse(&host).unwrap_err();
            assert!(err.to_string().contains("EM_AMDGPU"), "{err}");
        }
    }
}
