//! The float types, the split of large tensors across tasks, and refused inputs. The
//! block-quantized formats' own tests live with their code in `cleave_kernels::quant`.

use super::*;

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

#[test]
fn float_types() {
    let x = [1.5f32, -2.25, 0.0, 65504.0];
    let f32b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequantize(GgmlType::F32, &f32b, 4).unwrap(), x);
    let f16b: Vec<u8> = x.iter().flat_map(|&v| h(v)).collect();
    assert_eq!(dequantize(GgmlType::F16, &f16b, 4).unwrap(), x);
    let bf: Vec<u8> = [1.5f32, -2.25, 0.0, 3.0e38].iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
    let y = dequantize(GgmlType::BF16, &bf, 4).unwrap();
    assert_eq!(&y[..3], &[1.5, -2.25, 0.0]);
    assert!((y[3] - 3.0e38).abs() / 3.0e38 < 1e-2);
}

#[test]
fn large_tensors_split_across_tasks_identically() {
    // Q8_0 blocks with scales 2^-(i % 8) and arbitrary quants.
    let blocks = 3000 + 7;
    let bytes: Vec<u8> = (0..blocks)
        .flat_map(|i| {
            let mut b = h(1.0 / (1 << (i % 8)) as f32).to_vec();
            b.extend((0..32u32).map(|j| (i as u32 * 31 + j * 7) as u8));
            b
        })
        .collect();
    let all = dequantize(GgmlType::Q8_0, &bytes, 32 * blocks).unwrap();
    for (i, blk) in bytes.chunks(34).enumerate() {
        let one = dequantize(GgmlType::Q8_0, blk, 32).unwrap();
        assert_eq!(&all[32 * i..32 * i + 32], &one[..]);
    }
}

#[test]
fn bad_lengths_and_unsupported_types_are_refused() {
    assert_eq!(dequantize(GgmlType::Q8_0, &[0; 34], 31), Err(DequantError::BadLength { n: 31, bytes: 34 }));
    assert_eq!(dequantize(GgmlType::Q8_0, &[0; 33], 32), Err(DequantError::BadLength { n: 32, bytes: 33 }));
    assert_eq!(dequantize(GgmlType::Q3_K, &[0; 110], 256), Err(DequantError::Unsupported));
    for id in 0..64 {
        if let Some(t) = GgmlType::from_u32(id) {
            assert_eq!(t.id(), id);
            assert!(t.block_layout().0 > 0);
            if let Some(f) = t.quant_format() {
                assert_eq!(f.name(), t.to_string());
            }
        }
    }
    assert_eq!(GgmlType::from_u32(4), None);
}
