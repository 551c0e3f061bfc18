//! RoPE frequencies, tables and rotation against hand-computed numbers (Python, f64).

use cleave_kernels::{reference, rope_inv_freq, rope_rows, rope_table, Backend, CpuBackend, RopeScaling};

fn close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!(((*g as f64) - w).abs() <= 1e-6 * w.abs() + 1e-9, "got {got:?}, want {want:?}");
    }
}

#[test]
fn default_inv_freq() {
    let f = rope_inv_freq(8, 500000.0, &RopeScaling::None);
    close(&f, &[1.0, 0.03760603093086393, 0.001414213562373095, 5.318295896944989e-05]);
    let f = rope_inv_freq(4, 10000.0, &RopeScaling::None);
    close(&f, &[1.0, 0.01]);
}

#[test]
fn linear_scaling_divides_frequencies() {
    let f = rope_inv_freq(8, 500000.0, &RopeScaling::Linear { factor: 4.0 });
    close(&f, &[0.25, 0.009401507732715983, 0.00035355339059327376, 1.3295739742362472e-05]);
}

#[test]
fn llama3_scaling_has_three_regimes() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let f = rope_inv_freq(8, 500000.0, &scaling);
    // wavelengths 6.3 and 167 (< 2048: kept), 4443 (between: smoothed), 118145 (> 8192: / 8).
    close(&f, &[1.0, 0.03760603093086393, 0.0005248461609929547, 6.647869871181236e-06]);
}

#[test]
fn table_holds_cos_then_sin() {
    let f = rope_inv_freq(8, 500000.0, &RopeScaling::None);
    let t = rope_table(&f, 101);
    assert_eq!(t.len(), 101 * 8);
    let row7 = &t[7 * 8..8 * 8];
    assert!((row7[1] as f64 - 0.9655513894577367).abs() < 1e-6);
    assert!((row7[4 + 1] as f64 - 0.2602124407407033).abs() < 1e-6);
    assert!((t[100 * 8] as f64 - 0.8623188722876839).abs() < 1e-5);
    assert_eq!(&t[..8], &[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
}

/// A step's rows are the table's rows of its positions, bit for bit, in the step's order (the
/// engine builds them per step instead of keeping the table), and rotating with them at
/// `0..n` is rotating with the table at the positions.
#[test]
fn a_steps_rows_are_the_tables_rows_of_its_positions() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    for (hd, theta, scaling) in [(64, 100000.0, RopeScaling::None), (128, 500000.0, scaling)] {
        let f = rope_inv_freq(hd, theta, &scaling);
        let table = rope_table(&f, 40_000);
        let positions = [39_999u32, 0, 7, 7, 31_337, 1, 8191, 8192];
        let mut rows = vec![1.0; 3]; // stale contents are cleared
        rope_rows(&f, &positions, &mut rows);
        assert_eq!(rows.len(), positions.len() * hd);
        for (r, &p) in positions.iter().enumerate() {
            let (got, want) = (&rows[r * hd..(r + 1) * hd], &table[p as usize * hd..(p as usize + 1) * hd]);
            assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "row of position {p}");
        }
        let (heads, cpu) = (3, CpuBackend::new(Some(1)).unwrap());
        let x: Vec<f32> = (0..positions.len() * heads * hd).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let mut by_table = cpu.upload(&x).unwrap();
        cpu.rope(&mut by_table, &positions, heads, hd, &cpu.upload(&table).unwrap()).unwrap();
        let mut by_rows = cpu.upload(&x).unwrap();
        let in_order: Vec<u32> = (0..positions.len() as u32).collect();
        cpu.rope(&mut by_rows, &in_order, heads, hd, &cpu.upload(&rows).unwrap()).unwrap();
        let (a, b) = (cpu.download(&by_table).unwrap(), cpu.download(&by_rows).unwrap());
        assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn rotation_is_rotate_half() {
    let f = rope_inv_freq(4, 10000.0, &RopeScaling::None);
    let table = rope_table(&f, 4);
    let (c0, c1, s0, s1) = (3f32.cos(), 0.03f32.cos(), 3f32.sin(), 0.03f32.sin());
    let want = [1.0 * c0 - 3.0 * s0, 2.0 * c1 - 4.0 * s1, 3.0 * c0 + 1.0 * s0, 4.0 * c1 + 2.0 * s1];
    let mut x = vec![1.0, 2.0, 3.0, 4.0];
    reference::rope(&mut x, &[3], 1, 4, &table).unwrap();
    for (g, w) in x.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{x:?} vs {want:?}");
    }
    let mut y = vec![1.0, 2.0, 3.0, 4.0];
    CpuBackend::new(Some(1)).unwrap().rope(&mut y, &[3], 1, 4, &table).unwrap();
    assert_eq!(x, y);
}
