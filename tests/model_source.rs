//! `--model owner/name`: the binary resolves a hub id through a Hugging Face cache (HF_HOME) with
//! HF_HUB_OFFLINE=1, so nothing here touches the network. The environment is set on the child
//! processes only.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const COMMIT: &str = "f00dfeedf00dfeedf00dfeedf00dfeedf00dfeed";

/// The repository's `testdata/` folder (the tiny reference model and its golden outputs).
fn testdata_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

/// A fresh, empty folder for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cleave-model-source-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `$hf_home/hub/models--owner--name` laid out as hf-hub leaves it: `refs/main` holds the
/// commit, `snapshots/<commit>/` links to tiny-llama's files. Returns the snapshot folder.
fn fake_cache(hf_home: &Path, repo: &str) -> PathBuf {
    let repo_dir = hf_home.join("hub").join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), COMMIT).unwrap();
    let snapshot = repo_dir.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snapshot).unwrap();
    let model = testdata_dir().join("tiny-llama").canonicalize().unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let entry = entry.unwrap();
        std::os::unix::fs::symlink(entry.path(), snapshot.join(entry.file_name())).unwrap();
    }
    snapshot
}

fn generate(model: &str, hf_home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cleave"))
        .args(["generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens", "16", "--ignore-eos"])
        .env("HF_HOME", hf_home)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .env_remove("CLEAVE_MODEL")
        .output()
        .expect("run cleave")
}

#[test]
fn a_cached_hub_id_generates_what_the_folder_generates() {
    let home = temp_dir("cached");
    fake_cache(&home, "owner/name");
    let folder = testdata_dir().join("tiny-llama");
    let by_path = generate(folder.to_str().unwrap(), &home);
    assert!(by_path.status.success(), "{}", String::from_utf8_lossy(&by_path.stderr));
    let by_id = generate("owner/name", &home);
    assert!(by_id.status.success(), "{}", String::from_utf8_lossy(&by_id.stderr));
    assert!(!by_path.stdout.is_empty());
    assert_eq!(String::from_utf8_lossy(&by_id.stdout), String::from_utf8_lossy(&by_path.stdout));
    std::fs::remove_dir_all(&home).unwrap();
}

#[test]
fn an_uncached_id_offline_is_a_clear_error() {
    let home = temp_dir("uncached");
    fake_cache(&home, "owner/name");
    let out = generate("owner/other", &home);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("owner/other") && stderr.contains("HF_HUB_OFFLINE"), "{stderr}");
    assert!(stderr.contains("models--owner--other"), "names where it looked: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&home).unwrap();
}

#[test]
fn a_nonsense_model_is_a_clear_error() {
    let home = temp_dir("nonsense");
    let out = generate("/no/such/dir/model.gguf", &home);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("neither an existing path") && stderr.contains("owner/name"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&home).unwrap();
}
