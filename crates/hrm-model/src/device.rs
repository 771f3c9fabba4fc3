//! Device selection: CUDA, then Metal, then the CPU, unless the user names one.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::{Error, Result};

/// The device a user asked for (`--device`, `HRM_DEVICE`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceRequest {
    /// The first available of CUDA, Metal and the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
    /// Apple's Metal Performance Shaders; candle's Metal backend.
    Mps,
}

impl FromStr for DeviceRequest {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda),
            "mps" | "metal" => Ok(Self::Mps),
            other => Err(Error::Device(format!(
                "unknown device {other:?}: expected one of auto, cpu, cuda, mps"
            ))),
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Mps => "mps",
        })
    }
}

/// Resolves a request to a device, or says plainly why it cannot.
pub fn select_device(request: DeviceRequest) -> Result<Device> {
    match request {
        DeviceRequest::Cpu => Ok(Device::Cpu),
        DeviceRequest::Cuda => cuda(),
        DeviceRequest::Mps => metal(),
        DeviceRequest::Auto => Ok(cuda().or_else(|_| metal()).unwrap_or(Device::Cpu)),
    }
}

/// A short name for logs and `/readyz`: `cpu`, `cuda:0`, `mps`.
pub fn device_label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("mps:{gpu_id}"),
    }
}

fn cuda() -> Result<Device> {
    if !candle_core::utils::cuda_is_available() {
        return Err(Error::Device(
            "CUDA was requested, but this hrm was built without CUDA support; rebuild with `--features cuda`"
                .into(),
        ));
    }
    Device::new_cuda(0).map_err(|e| {
        Error::Device(format!(
            "CUDA was requested, but no usable CUDA device was found: {e}"
        ))
    })
}

fn metal() -> Result<Device> {
    if !candle_core::utils::metal_is_available() {
        return Err(Error::Device(
            "mps was requested, but this hrm was built without Metal support; rebuild with `--features metal` on macOS"
                .into(),
        ));
    }
    Device::new_metal(0).map_err(|e| {
        Error::Device(format!(
            "mps was requested, but no usable Metal device was found: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_names() {
        assert_eq!("cpu".parse::<DeviceRequest>().unwrap(), DeviceRequest::Cpu);
        assert_eq!(
            "CUDA".parse::<DeviceRequest>().unwrap(),
            DeviceRequest::Cuda
        );
        assert_eq!("mps".parse::<DeviceRequest>().unwrap(), DeviceRequest::Mps);
        assert_eq!(
            "auto".parse::<DeviceRequest>().unwrap(),
            DeviceRequest::Auto
        );
        let err = "tpu".parse::<DeviceRequest>().unwrap_err().to_string();
        assert!(
            err.contains("tpu") && err.contains("cpu, cuda, mps"),
            "{err}"
        );
    }

    #[test]
    fn auto_falls_back_to_an_available_device() {
        let device = select_device(DeviceRequest::Auto).unwrap();
        if !candle_core::utils::cuda_is_available() && !candle_core::utils::metal_is_available() {
            assert!(device.is_cpu());
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_get_it() {
        let err = select_device(DeviceRequest::Cuda).unwrap_err().to_string();
        assert!(
            err.contains("built without CUDA") && err.contains("--features cuda"),
            "{err}"
        );
    }

    #[cfg(not(feature = "metal"))]
    #[test]
    fn mps_without_the_feature_says_how_to_get_it() {
        let err = select_device(DeviceRequest::Mps).unwrap_err().to_string();
        assert!(err.contains("built without Metal"), "{err}");
    }
}
