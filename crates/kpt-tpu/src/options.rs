//! The compile options `PJRT_Client_Compile` takes: a serialized
//! `xla.CompileOptionsProto` (`xla/pjrt/proto/compile_options.proto`), of which kpt
//! sets the fields below; every other field keeps XLA's default.

use prost::Message;

/// How XLA compiles a program: replicas and partitions of one computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// Copies of the computation that run at once, one per device (data parallel).
    pub num_replicas: i64,
    /// Parts one computation is split into across devices (model parallel).
    pub num_partitions: i64,
    /// Partition with SPMD (one program, sharded by annotations) when
    /// `num_partitions > 1`.
    pub use_spmd_partitioning: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
        }
    }
}

/// `xla.ExecutableBuildOptionsProto`, the fields kpt sets.
#[derive(Clone, PartialEq, Message)]
struct ExecutableBuildOptionsProto {
    /// -1: not set (XLA picks).
    #[prost(int64, tag = "1")]
    device_ordinal: i64,
    #[prost(int64, tag = "4")]
    num_replicas: i64,
    #[prost(int64, tag = "5")]
    num_partitions: i64,
    #[prost(bool, tag = "6")]
    use_spmd_partitioning: bool,
}

/// `xla.CompileOptionsProto`, the fields kpt sets.
#[derive(Clone, PartialEq, Message)]
struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    executable_build_options: Option<ExecutableBuildOptionsProto>,
}

impl CompileOptions {
    /// The serialized `CompileOptionsProto`.
    pub fn to_proto_bytes(&self) -> Vec<u8> {
        CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                device_ordinal: -1,
                num_replicas: self.num_replicas,
                num_partitions: self.num_partitions,
                use_spmd_partitioning: self.use_spmd_partitioning,
            }),
        }
        .encode_to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_the_proto_wire_format() {
        let bytes = CompileOptions {
            num_replicas: 2,
            num_partitions: 1,
            use_spmd_partitioning: true,
        }
        .to_proto_bytes();
        // Field 3, length-delimited, holding: field 1 = -1 (ten-byte varint), field 4 =
        // 2, field 5 = 1, field 6 = true.
        let mut inner = vec![0x08];
        inner.extend([0xff; 9]);
        inner.push(0x01);
        inner.extend([0x20, 0x02, 0x28, 0x01, 0x30, 0x01]);
        let mut want = vec![0x1a, inner.len() as u8];
        want.extend(inner);
        assert_eq!(bytes, want);
    }
}
