//! One way for `hrm serve`, `hrm hub` and `hrm worker` to read their settings. Highest first:
//!
//! 1. command-line flags and 2. environment variables, both read by clap into the program's
//!    arguments;
//! 3. the program's section of a YAML file (`serve:` and `hub:` of `hrm.yaml`; the whole of
//!    the worker's own file);
//! 4. the defaults: clap's `default_value` where an argument has one, else whatever the program
//!    resolves an unset value to.
//!
//! Every layer is sparse; figment merges them and deserializes the result back into the
//! arguments type, so a wrongly typed value is an error that names the file and the key.
//!
//! Invariants: a setting's key in the file is its argument's id, with `.` for nesting (the
//! worker's `server.url` is `#[arg(id = "server.url", long = "server-url")]`); a key that no
//! argument has is an error, as is a key the program never reads from a file (secrets, and
//! switches such as `--print-config`); a value from the file counts only where neither a flag
//! nor an environment variable gave one, which clap's value sources tell apart from defaults.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ArgMatches;
use clap::parser::ValueSource;
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A YAML settings file, or one section of it.
#[derive(Debug, Clone)]
pub struct SettingsFile {
    path: PathBuf,
    section: Option<String>,
    values: Dict,
    /// Keys that belong to sibling commands reading the same section: skipped, not refused.
    shared_with: BTreeSet<String>,
}

impl SettingsFile {
    /// The file at `explicit`, else `default` when it exists, else none.
    pub fn find(
        explicit: Option<&Path>,
        default: &Path,
        section: Option<&str>,
    ) -> Result<Option<Self>> {
        match explicit {
            Some(path) => Self::read(path, section).map(Some),
            None if default.exists() => Self::read(default, section).map(Some),
            None => Ok(None),
        }
    }

    /// Reads `path`, keeping `section` of it (the whole file when none); a missing section is
    /// an empty one.
    pub fn read(path: &Path, section: Option<&str>) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        Self::parse(&text, path, section)
    }

    fn parse(text: &str, path: &Path, section: Option<&str>) -> Result<Self> {
        let invalid =
            |what: String| anyhow::anyhow!("invalid config file {}: {what}", path.display());
        let file: Option<Dict> =
            serde_norway::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut file = file.unwrap_or_default();
        let values = match section {
            None => file,
            Some(name) => match file.remove(name) {
                None | Some(Value::Empty(..)) => Dict::new(),
                Some(Value::Dict(_, dict)) => dict,
                Some(_) => return Err(invalid(format!("`{name}` must be a mapping"))),
            },
        };
        Ok(Self {
            path: path.to_path_buf(),
            section: section.map(str::to_string),
            values,
            shared_with: BTreeSet::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Skips, instead of refusing, these keys of the section: another command that reads the
    /// same section takes them.
    pub fn shared_with(mut self, keys: impl IntoIterator<Item = String>) -> Self {
        self.shared_with.extend(keys);
        self
    }

    fn describe(&self) -> String {
        match &self.section {
            Some(section) => format!("the `{section}:` section of {}", self.path.display()),
            None => self.path.display().to_string(),
        }
    }
}

/// The file's values as checked, named after the file in figment's errors.
struct FileLayer {
    name: String,
    values: Dict,
}

impl Provider for FileLayer {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        Ok(Profile::Default.collect(self.values.clone()))
    }
}

/// `args` (as clap parsed them from `matches`) with the file's values layered under the flags
/// and environment variables: see the module documentation. `never_from_file` lists the keys
/// the file may not set.
pub fn layered<T: Serialize + DeserializeOwned>(
    args: T,
    matches: &ArgMatches,
    file: Option<&SettingsFile>,
    never_from_file: &[&str],
) -> Result<T> {
    match file {
        Some(file) => layered_into(&args, matches, file, never_from_file),
        None => Ok(args),
    }
}

/// [`layered`] into another type than the arguments': the worker's flags override keys of its
/// configuration file, whose shape is the specification's.
pub fn layered_into<T: DeserializeOwned>(
    args: &impl Serialize,
    matches: &ArgMatches,
    file: &SettingsFile,
    never_from_file: &[&str],
) -> Result<T> {
    let parsed = match Value::serialize(args)? {
        Value::Dict(_, dict) => dict,
        _ => bail!("settings must be a struct"),
    };
    let mut known = BTreeSet::new();
    leaf_paths(&parsed, "", &mut known);
    let mut from_file = file.values.clone();
    check_keys(&mut from_file, "", &known, never_from_file, file)?;
    let explicit: BTreeSet<String> = matches
        .ids()
        .map(|id| id.as_str())
        .filter(|id| {
            matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(str::to_string)
        .collect();
    let (flags, defaults) = split(parsed, "", &explicit);
    let file = FileLayer {
        name: file.describe(),
        values: from_file,
    };
    Figment::new()
        .merge(figment::providers::Serialized::defaults(defaults))
        .merge(file)
        .merge(figment::providers::Serialized::defaults(flags))
        .extract()
        .map_err(|e| anyhow::anyhow!("{e}"))
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Every settable key of the arguments, as dotted paths.
fn leaf_paths(dict: &Dict, prefix: &str, out: &mut BTreeSet<String>) {
    for (key, value) in dict {
        let path = join(prefix, key);
        match value {
            Value::Dict(_, inner) => leaf_paths(inner, &path, out),
            _ => {
                out.insert(path);
            }
        }
    }
}

/// Refuses keys no argument has and keys never read from a file; drops keys of sibling
/// commands.
fn check_keys(
    dict: &mut Dict,
    prefix: &str,
    known: &BTreeSet<String>,
    never: &[&str],
    file: &SettingsFile,
) -> Result<()> {
    let keys: Vec<String> = dict.keys().cloned().collect();
    for key in keys {
        let path = join(prefix, &key);
        if never.contains(&path.as_str()) {
            bail!("{} may not set `{path}`", file.describe());
        }
        if known.contains(&path) {
            continue;
        }
        let nested = known.iter().any(|k| k.starts_with(&format!("{path}.")));
        match dict.get_mut(&key) {
            Some(Value::Dict(_, inner)) if nested => check_keys(inner, &path, known, never, file)?,
            _ if file.shared_with.contains(&path) => {
                dict.remove(&key);
            }
            _ => bail!("unknown key `{path}` in {}", file.describe()),
        }
    }
    Ok(())
}

/// Splits the parsed arguments into what a flag or an environment variable set, and the rest;
/// unset values (`None`) are in neither, so that a lower layer shows through.
fn split(dict: Dict, prefix: &str, explicit: &BTreeSet<String>) -> (Dict, Dict) {
    let (mut set, mut rest) = (Dict::new(), Dict::new());
    for (key, value) in dict {
        let path = join(prefix, &key);
        match value {
            Value::Empty(..) => {}
            Value::Dict(tag, inner) => {
                let (s, r) = split(inner, &path, explicit);
                if !s.is_empty() {
                    set.insert(key.clone(), Value::Dict(tag, s));
                }
                // Kept even when empty: a nested struct of unset options is still a struct.
                rest.insert(key, Value::Dict(tag, r));
            }
            value if explicit.contains(&path) => {
                set.insert(key, value);
            }
            value => {
                rest.insert(key, value);
            }
        }
    }
    (set, rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, CommandFactory, FromArgMatches, Parser};
    use serde::Deserialize;

    #[derive(Parser, Serialize, Deserialize, Debug)]
    struct Flags {
        #[arg(long)]
        port: Option<u16>,
        #[arg(long, default_value_t = 4)]
        batch: usize,
        #[arg(long)]
        secret: Option<String>,
        #[command(flatten)]
        #[serde(flatten)]
        limits: Limits,
        #[command(flatten)]
        server: Server,
    }

    #[derive(Args, Serialize, Deserialize, Debug)]
    struct Limits {
        #[arg(long)]
        timeout: Option<u64>,
    }

    #[derive(Args, Serialize, Deserialize, Debug)]
    struct Server {
        #[arg(id = "server.url", long = "server-url")]
        url: Option<String>,
    }

    fn resolve(argv: &[&str], yaml: &str) -> Result<Flags> {
        let matches =
            Flags::command().try_get_matches_from(std::iter::once("hrm").chain(argv.to_vec()))?;
        let flags = Flags::from_arg_matches(&matches)?;
        let file = SettingsFile::parse(yaml, Path::new("hrm.yaml"), Some("app"))?
            .shared_with(["sibling".to_string()]);
        layered(flags, &matches, Some(&file), &["secret"])
    }

    #[test]
    fn a_flag_beats_the_file_and_the_file_beats_the_default() {
        let yaml = "app:\n  port: 2\n  batch: 8\n  timeout: 30\n  server:\n    url: http://file\n";
        let flags = resolve(&["--port", "1"], yaml).unwrap();
        assert_eq!(flags.port, Some(1), "flag over file");
        assert_eq!(flags.batch, 8, "file over clap's default");
        assert_eq!(flags.limits.timeout, Some(30), "a flattened argument");
        assert_eq!(
            flags.server.url.as_deref(),
            Some("http://file"),
            "a nested key"
        );
        let flags = resolve(&["--batch", "4", "--server-url", "http://flag"], yaml).unwrap();
        assert_eq!(flags.batch, 4, "a flag equal to the default still wins");
        assert_eq!(flags.server.url.as_deref(), Some("http://flag"));
        let flags = resolve(&[], "other: {}\n").unwrap();
        assert_eq!(
            (flags.port, flags.batch),
            (None, 4),
            "no section: the defaults"
        );
    }

    #[test]
    fn unknown_forbidden_and_mistyped_keys_are_errors_that_name_them() {
        let err = |yaml: &str| resolve(&[], yaml).unwrap_err().to_string();
        let unknown = err("app:\n  prot: 1\n");
        assert!(
            unknown.contains("`prot`") && unknown.contains("hrm.yaml"),
            "{unknown}"
        );
        assert!(err("app:\n  server:\n    uri: x\n").contains("`server.uri`"));
        assert!(err("app:\n  secret: inline\n").contains("may not set `secret`"));
        let mistyped = err("app:\n  port: many\n");
        assert!(mistyped.contains("port"), "{mistyped}");
        assert!(err("app: 3\n").contains("mapping"));
        let flags = resolve(&[], "app:\n  sibling: 1\n  port: 5\n").unwrap();
        assert_eq!(flags.port, Some(5), "a sibling command's key is skipped");
    }
}
