//! Hand-run (Linux, glibc): the heap a model's tokenizer holds, whole and as a node keeps it
//! (`Tokenizer::for_decoding`), from glibc's `mallinfo2` after `malloc_trim`, with the process's
//! RSS beside it.
//!
//! Usage: `cargo run --release -p cleave-engine --example tokenizer_heap -- MODEL`.
use cleave_engine::model::ModelFiles;

#[repr(C)]
#[derive(Default)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

extern "C" {
    fn mallinfo2() -> MallInfo2;
    fn malloc_trim(pad: usize) -> i32;
}

/// Bytes in use on the heap (malloc'd, mmapped chunks included), after a trim.
fn in_use() -> usize {
    // SAFETY: glibc's own functions, no arguments to get wrong; mallinfo2 returns by value.
    let m = unsafe {
        malloc_trim(0);
        mallinfo2()
    };
    m.uordblks + m.hblkhd
}

fn rss_kib() -> String {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find(|l| l.starts_with("VmRSS")).unwrap_or("VmRSS: ?").split_whitespace().nth(1).unwrap_or("?").into()
}

fn main() {
    let path = std::env::args().nth(1).expect("usage: tokenizer_heap MODEL (a GGUF file or a model folder)");
    let base = in_use();
    let files = ModelFiles::open(std::path::Path::new(&path)).expect("opening the model");
    let whole = files.tokenizer.clone();
    drop(files);
    let with_whole = in_use();
    println!("whole tokenizer: {:>6} KiB of heap (RSS {} KiB)", (with_whole - base) / 1024, rss_kib());
    let slim = whole.for_decoding().expect("a decode-only copy");
    println!("decode-only copy: {:>6} KiB of heap", (in_use() - with_whole) / 1024);
    drop(whole);
    println!("the copy alone: {:>6} KiB of heap (RSS {} KiB)", (in_use() - base) / 1024, rss_kib());
    drop(slim);
}
