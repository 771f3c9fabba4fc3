//! An environment variable is a flag's equal: it beats the file. Alone in its test binary,
//! because it sets a variable of the process.

use clap::{CommandFactory, FromArgMatches, Parser};
use hrm_settings::{SettingsFile, layered};
use serde::{Deserialize, Serialize};

#[derive(Parser, Serialize, Deserialize)]
struct Flags {
    #[arg(long, env = "HRM_SETTINGS_TEST_PORT")]
    port: Option<u16>,
    #[arg(long, env = "HRM_SETTINGS_TEST_HOST", default_value = "0.0.0.0")]
    host: String,
}

#[test]
fn an_environment_variable_beats_the_file() {
    // SAFETY: this binary's only test, so no other thread reads the environment meanwhile.
    unsafe { std::env::set_var("HRM_SETTINGS_TEST_PORT", "7") };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hrm.yaml");
    std::fs::write(&path, "app:\n  port: 9\n  host: 127.0.0.1\n").unwrap();
    let matches = Flags::command().get_matches_from(["hrm"]);
    let flags = Flags::from_arg_matches(&matches).unwrap();
    let file = SettingsFile::read(&path, Some("app")).unwrap();
    let flags = layered(flags, &matches, Some(&file), &[]).unwrap();
    assert_eq!(flags.port, Some(7));
    assert_eq!(flags.host, "127.0.0.1", "the file beats the default");
}
