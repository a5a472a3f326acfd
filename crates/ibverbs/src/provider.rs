//! [`IbvProvider`]: loads libibverbs on first use, lists its devices and opens them by name; and
//! [`ForkSafety`], what holds for memory regions if the process forks.

use std::ffi::CStr;
use std::sync::Arc;

use lightpath_verbs::{Error, Provider, Result};

use crate::device::{IbvConfig, IbvDevice};
use crate::ffi::library::{Api, LoadError};
use crate::ffi::types::fork_status;

/// The ibverbs provider. Devices it opens use its `config` (port and GID index).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbvProvider {
    /// Port and GID choice of opened devices.
    pub config: IbvConfig,
}

/// What happens to registered memory if the process calls `fork()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkSafety {
    /// The kernel copies pinned pages for the child at fork time (Linux 5.13+ with rdma-core
    /// 35+: `IBV_FORK_UNNEEDED`): forking is safe, for every region.
    KernelHandles,
    /// `ibv_fork_init` ran: registered ranges are `MADV_DONTFORK` (the child does not get
    /// them at all).
    ForkInitDone,
    /// Neither: a fork while regions are registered could leave the parent's pages copied
    /// away from the device. Lightpath's own regions are `MADV_DONTFORK` anyway, and
    /// application memory passed to `reg_vec` is copied into such a region instead of being
    /// registered in place.
    Unprotected,
    /// The library is too old to say (before rdma-core 35); treated like `Unprotected`.
    Unknown,
}

impl ForkSafety {
    /// What `ibv_is_fork_initialized` says, from a checked conversion.
    pub fn from_raw(raw: Option<u32>) -> Self {
        match raw {
            Some(fork_status::UNNEEDED) => ForkSafety::KernelHandles,
            Some(fork_status::ENABLED) => ForkSafety::ForkInitDone,
            Some(fork_status::DISABLED) => ForkSafety::Unprotected,
            _ => ForkSafety::Unknown,
        }
    }

    /// Whether application memory can be registered in place without risk from a fork.
    pub fn in_place_registration_is_safe(self) -> bool {
        matches!(self, ForkSafety::KernelHandles | ForkSafety::ForkInitDone)
    }

    /// One sentence for users.
    pub fn describe(self) -> &'static str {
        match self {
            ForkSafety::KernelHandles => "fork is safe: the kernel copies pinned pages for the child",
            ForkSafety::ForkInitDone => "fork is safe: ibv_fork_init ran, registered memory is not inherited",
            ForkSafety::Unprotected | ForkSafety::Unknown => {
                "fork is not protected by the kernel: Lightpath regions are not inherited by a child \
                 (MADV_DONTFORK) and reg_vec copies instead of pinning in place"
            }
        }
    }
}

impl IbvProvider {
    /// A provider whose devices use port `port` and GID `gid_index` (automatic when `None`).
    pub fn with_config(config: IbvConfig) -> Self {
        Self { config }
    }

    /// Loads libibverbs now (it is otherwise loaded on first use) and says why it cannot be.
    pub fn load() -> std::result::Result<(), LoadError> {
        Api::get().map(|_| ())
    }

    /// The path or name libibverbs was loaded from.
    pub fn library_path() -> Option<String> {
        Api::get().ok().map(|api| api.path.clone())
    }

    /// Fork safety of this process's registrations, as libibverbs reports it.
    pub fn fork_safety() -> Result<ForkSafety> {
        let api = api()?;
        // SAFETY: a function without arguments that reads libibverbs' global state.
        let raw = api.is_fork_initialized.map(|f| unsafe { f() });
        Ok(ForkSafety::from_raw(raw))
    }

    /// Opens the first device libibverbs lists (for tools run without a device name).
    pub fn open_first(&self) -> Result<IbvDevice> {
        let names = self.devices()?;
        match names.first() {
            Some(name) => self.open(name),
            None => Err(no_devices()),
        }
    }
}

fn api() -> Result<Arc<Api>> {
    Api::get().map_err(|err| Error::Unavailable(err.to_string()))
}

/// The explanation for an empty device list.
fn no_devices() -> Error {
    Error::Unavailable(
        "libibverbs found no RDMA devices (no NIC driver loaded, no provider library for it in \
         ibverbs-providers, or no SoftRoCE link: `rdma link add rxe0 type rxe netdev eth0`)"
            .into(),
    )
}

/// The device list, freed when dropped.
struct DeviceList {
    api: Arc<Api>,
    list: *mut *mut std::ffi::c_void,
    len: usize,
}

impl DeviceList {
    fn get(api: Arc<Api>) -> Result<Self> {
        let mut len = 0i32;
        // SAFETY: `len` is a valid out-pointer; the returned array is freed in Drop.
        let list = unsafe { (api.get_device_list)(&mut len) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOSYS) {
                // libibverbs says ENOSYS when the kernel offers no RDMA at all.
                return Err(Error::Unavailable(
                    "libibverbs is installed, but the kernel has no RDMA devices or verbs support loaded \
                     (no /sys/class/infiniband: load the NIC's RDMA driver and ib_uverbs, or create a \
                     SoftRoCE link with `rdma link add rxe0 type rxe netdev eth0`)"
                        .into(),
                ));
            }
            return Err(crate::error::from_errno("ibv_get_device_list"));
        }
        Ok(Self { api, list, len: usize::try_from(len).unwrap_or(0) })
    }

    fn raw(&self, index: usize) -> *mut std::ffi::c_void {
        // SAFETY: `index < len`, within the array the library returned.
        unsafe { *self.list.add(index) }
    }

    fn name(&self, index: usize) -> String {
        // SAFETY: a listed device has a NUL-terminated name owned by the library.
        unsafe { CStr::from_ptr((self.api.get_device_name)(self.raw(index))) }.to_string_lossy().into_owned()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once; open contexts do not
        // depend on it.
        unsafe { (self.api.free_device_list)(self.list) };
    }
}

impl Provider for IbvProvider {
    type Device = IbvDevice;

    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn devices(&self) -> Result<Vec<String>> {
        let list = DeviceList::get(api()?)?;
        Ok((0..list.len).map(|i| list.name(i)).collect())
    }

    fn open(&self, name: &str) -> Result<IbvDevice> {
        let api = api()?;
        let list = DeviceList::get(Arc::clone(&api))?;
        let names: Vec<String> = (0..list.len).map(|i| list.name(i)).collect();
        match names.iter().position(|n| n == name) {
            Some(index) => IbvDevice::open_raw(api, list.raw(index), self.config),
            None if names.is_empty() => Err(no_devices()),
            None => Err(Error::Unavailable(format!(
                "no RDMA device named {name:?}; libibverbs lists: {}",
                names.join(", ")
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fork_status_conversion_is_checked() {
        assert_eq!(ForkSafety::from_raw(Some(2)), ForkSafety::KernelHandles);
        assert_eq!(ForkSafety::from_raw(Some(1)), ForkSafety::ForkInitDone);
        assert_eq!(ForkSafety::from_raw(Some(0)), ForkSafety::Unprotected);
        assert_eq!(ForkSafety::from_raw(Some(7)), ForkSafety::Unknown);
        assert_eq!(ForkSafety::from_raw(None), ForkSafety::Unknown);
        assert!(ForkSafety::KernelHandles.in_place_registration_is_safe());
        assert!(!ForkSafety::Unknown.in_place_registration_is_safe());
    }
}
