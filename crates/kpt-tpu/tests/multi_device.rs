//! Programs over several devices of one plugin: replicas with a cross-replica
//! all-reduce, and SPMD tensor-parallel matmuls whose collectives XLA inserts, on the
//! CPU plugin's devices. Skipped (with a note) where no plugin is installed.

mod common;

use kpt_core::rand::SplitMix64;
use kpt_tpu::{Buffer, Client, CompileOptions};

fn client_with(devices: usize) -> Option<Client> {
    let client = common::client()?;
    let n = client.devices().unwrap().len();
    if n < devices {
        eprintln!("skipped: the plugin offers {n} device(s), the test needs {devices}");
        return None;
    }
    Some(client)
}

fn values(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

#[test]
fn replicas_all_reduce_across_every_device() {
    let Some(client) = client_with(2) else {
        return;
    };
    let devices = client.devices().unwrap();
    let n = devices.len();
    let group: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let program = format!(
        "module @all_reduce attributes {{mhlo.num_replicas = {n} : i32, mhlo.num_partitions = 1 : i32}} {{
  func.func public @main(%x: tensor<5xf32>) -> tensor<5xf32> {{
    %r = \"stablehlo.all_reduce\"(%x) ({{
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = \"stablehlo.add\"(%a, %b) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      \"stablehlo.return\"(%s) : (tensor<f32>) -> ()
    }}) {{replica_groups = dense<[[{}]]> : tensor<1x{n}xi64>}} : (tensor<5xf32>) -> tensor<5xf32>
    \"func.return\"(%r) : (tensor<5xf32>) -> ()
  }}
}}",
        group.join(", ")
    );
    let options = CompileOptions {
        num_replicas: n as i64,
        ..CompileOptions::default()
    };
    let exe = client.compile(program.as_bytes(), &options).unwrap();
    let mut rng = SplitMix64::new(3);
    let parts: Vec<Vec<f32>> = (0..n).map(|_| values(&mut rng, 5)).collect();
    let bufs: Vec<Buffer> = parts
        .iter()
        .zip(&devices)
        .map(|(p, d)| client.buffer(p, &[5], d).unwrap())
        .collect();
    let args: Vec<Vec<&Buffer>> = bufs.iter().map(|b| vec![b]).collect();
    let outs = exe.execute_on_devices(&args).unwrap();
    assert_eq!(outs.len(), n);
    let want: Vec<f64> = (0..5)
        .map(|i| parts.iter().map(|p| f64::from(p[i])).sum())
        .collect();
    for (d, out) in outs.iter().enumerate() {
        let got = out[0].to_vec::<f32>().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() < 1e-5,
                "replica {d}: {got:?} vs {want:?}"
            );
        }
    }
}

/// `x [m, k] · w [k, n]` on two devices, `w` split by columns (each device computes its
/// half of the output) or by rows with `x` split by columns (each device a partial
/// product, which XLA sums with an all-reduce it inserts for the replicated output).
#[test]
fn spmd_partitions_a_matmul_across_two_devices() {
    let Some(client) = client_with(2) else {
        return;
    };
    let devices = client.devices().unwrap();
    let (m, k, n) = (6usize, 8usize, 10usize);
    let mut rng = SplitMix64::new(4);
    let (x, w) = (values(&mut rng, m * k), values(&mut rng, k * n));
    let want: Vec<f64> = (0..m * n)
        .map(|ij| {
            let (i, j) = (ij / n, ij % n);
            (0..k)
                .map(|p| f64::from(x[i * k + p]) * f64::from(w[p * n + j]))
                .sum()
        })
        .collect();
    let options = CompileOptions {
        num_replicas: 1,
        num_partitions: 2,
        use_spmd_partitioning: true,
    };
    let program = |x_sh: &str, w_sh: &str, out_sh: &str| {
        format!(
            "module @tp attributes {{mhlo.num_replicas = 1 : i32, mhlo.num_partitions = 2 : i32}} {{
  func.func public @main(%x: tensor<{m}x{k}xf32> {{mhlo.sharding = \"{x_sh}\"}}, %w: tensor<{k}x{n}xf32> {{mhlo.sharding = \"{w_sh}\"}}) -> (tensor<{m}x{n}xf32> {{mhlo.sharding = \"{out_sh}\"}}) {{
    %c = \"stablehlo.dot_general\"(%x, %w) {{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}} : (tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32>
    \"func.return\"(%c) : (tensor<{m}x{n}xf32>) -> ()
  }}
}}"
        )
    };
    let cols = |a: &[f32], rows: usize, width: usize, from: usize, to: usize| -> Vec<f32> {
        (0..rows)
            .flat_map(|r| a[r * width + from..r * width + to].to_vec())
            .collect()
    };
    let check = |got: &[f32], want: &[f64], what: &str| {
        for (g, w) in got.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{what}: {g} vs {w}");
        }
    };

    // Column-parallel: each device holds half of w's columns and gives half the output.
    let exe = client
        .compile(
            program("{replicated}", "{devices=[1,2]0,1}", "{devices=[1,2]0,1}").as_bytes(),
            &options,
        )
        .unwrap();
    let h = n / 2;
    let xb: Vec<Buffer> = (0..2)
        .map(|d| {
            client
                .buffer(&x, &[m as i64, k as i64], &devices[d])
                .unwrap()
        })
        .collect();
    let wb: Vec<Buffer> = (0..2)
        .map(|d| {
            let part = cols(&w, k, n, d * h, (d + 1) * h);
            client
                .buffer(&part, &[k as i64, h as i64], &devices[d])
                .unwrap()
        })
        .collect();
    let outs = exe
        .execute_on_devices(&[vec![&xb[0], &wb[0]], vec![&xb[1], &wb[1]]])
        .unwrap();
    for (d, out) in outs.iter().enumerate() {
        assert_eq!(out[0].dims().unwrap(), [m as i64, h as i64]);
        let want_half: Vec<f64> = (0..m)
            .flat_map(|i| want[i * n + d * h..i * n + (d + 1) * h].to_vec())
            .collect();
        check(
            &out[0].to_vec::<f32>().unwrap(),
            &want_half,
            "column-parallel",
        );
    }

    // Row-parallel: x split by columns, w by rows; the replicated output needs the sum of
    // both devices' partial products.
    let exe = client
        .compile(
            program("{devices=[1,2]0,1}", "{devices=[2,1]0,1}", "{replicated}").as_bytes(),
            &options,
        )
        .unwrap();
    let hk = k / 2;
    let xb: Vec<Buffer> = (0..2)
        .map(|d| {
            let part = cols(&x, m, k, d * hk, (d + 1) * hk);
            client
                .buffer(&part, &[m as i64, hk as i64], &devices[d])
                .unwrap()
        })
        .collect();
    let wb: Vec<Buffer> = (0..2)
        .map(|d| {
            let part = w[d * hk * n..(d + 1) * hk * n].to_vec();
            client
                .buffer(&part, &[hk as i64, n as i64], &devices[d])
                .unwrap()
        })
        .collect();
    let outs = exe
        .execute_on_devices(&[vec![&xb[0], &wb[0]], vec![&xb[1], &wb[1]]])
        .unwrap();
    for out in &outs {
        assert_eq!(out[0].dims().unwrap(), [m as i64, n as i64]);
        check(&out[0].to_vec::<f32>().unwrap(), &want, "row-parallel");
    }
}
