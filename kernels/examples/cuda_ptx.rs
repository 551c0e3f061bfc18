//! Prints the kernels' PTX for compute capability MAJOR.MINOR (default 9.0), e.g. to check
//! registers and spills with `ptxas -v` without a GPU: `cuda_ptx 9 0 > k.ptx`.
#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    let mut a = std::env::args().skip(1).map(|s| s.parse::<i32>());
    let cc = (a.next().unwrap_or(Ok(9))?, a.next().unwrap_or(Ok(0))?);
    print!("{}", cleave_kernels::cuda::compile_kernels(Some(cc))?);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("built without the `cuda` feature");
}
