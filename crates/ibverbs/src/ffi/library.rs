//! Loading `libibverbs.so.1` at run time and resolving the functions Lightpath calls.
//!
//! Nothing links against libibverbs: the `lightpath` binary starts on machines without
//! rdma-core, and only this module's [`Api::get`] tries `dlopen`. The exported (default-version)
//! symbols are those of libibverbs 1.1 and later; the ones newer releases added
//! (`_ibv_query_gid_table`, `ibv_is_fork_initialized`) are optional and looked up separately.
//!
//! The data-path calls are not here: `verbs.h` implements them as static inline functions that
//! call through the context's `ops` table, and [`crate::ffi::ops`] does the same.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use super::types::{
    IbvCompChannel, IbvContext, IbvCq, IbvDeviceAttr, IbvGid, IbvGidEntry, IbvMr, IbvPortAttr, IbvQp,
    IbvQpAttr, IbvQpInitAttr,
};

/// The file name `dlopen` looks for (the run-time library of rdma-core's libibverbs1 package).
pub const LIBRARY_NAME: &str = "libibverbs.so.1";

/// Environment variable naming another file to load instead of [`LIBRARY_NAME`] (for tests and
/// unusual installations).
pub const LIBRARY_ENV: &str = "LIGHTPATH_IBVERBS_LIB";

/// Opaque `struct ibv_device`.
pub type IbvDevice = c_void;
/// Opaque `struct ibv_pd`.
pub type IbvPd = c_void;

/// The resolved entry points, kept together with the library that holds them.
pub struct Api {
    /// Keeps the code the function pointers below point into mapped. Never dropped while any
    /// `Arc<Api>` exists, and every verbs object holds one.
    _library: libloading::Library,
    /// Where the library came from (the name passed to `dlopen`).
    pub path: String,
    pub get_device_list: unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut IbvDevice,
    pub free_device_list: unsafe extern "C" fn(list: *mut *mut IbvDevice),
    pub get_device_name: unsafe extern "C" fn(device: *mut IbvDevice) -> *const c_char,
    pub open_device: unsafe extern "C" fn(device: *mut IbvDevice) -> *mut IbvContext,
    pub close_device: unsafe extern "C" fn(context: *mut IbvContext) -> c_int,
    pub query_device: unsafe extern "C" fn(context: *mut IbvContext, attr: *mut IbvDeviceAttr) -> c_int,
    pub query_port: unsafe extern "C" fn(context: *mut IbvContext, port: u8, attr: *mut IbvPortAttr) -> c_int,
    pub query_gid:
        unsafe extern "C" fn(context: *mut IbvContext, port: u8, index: c_int, gid: *mut IbvGid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(context: *mut IbvContext) -> *mut IbvPd,
    pub dealloc_pd: unsafe extern "C" fn(pd: *mut IbvPd) -> c_int,
    pub reg_mr:
        unsafe extern "C" fn(pd: *mut IbvPd, addr: *mut c_void, length: usize, access: c_int) -> *mut IbvMr,
    pub dereg_mr: unsafe extern "C" fn(mr: *mut IbvMr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(context: *mut IbvContext) -> *mut IbvCompChannel,
    pub destroy_comp_channel: unsafe extern "C" fn(channel: *mut IbvCompChannel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        context: *mut IbvContext,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut IbvCompChannel,
        comp_vector: c_int,
    ) -> *mut IbvCq,
    pub destroy_cq: unsafe extern "C" fn(cq: *mut IbvCq) -> c_int,
    pub get_cq_event: unsafe extern "C" fn(
        channel: *mut IbvCompChannel,
        cq: *mut *mut IbvCq,
        cq_context: *mut *mut c_void,
    ) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(cq: *mut IbvCq, nevents: u32),
    pub create_qp: unsafe extern "C" fn(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp,
    pub destroy_qp: unsafe extern "C" fn(qp: *mut IbvQp) -> c_int,
    pub modify_qp: unsafe extern "C" fn(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int,
    pub query_qp: unsafe extern "C" fn(
        qp: *mut IbvQp,
        attr: *mut IbvQpAttr,
        mask: c_int,
        init_attr: *mut IbvQpInitAttr,
    ) -> c_int,
    /// `_ibv_query_gid_table` (rdma-core ≥ 31): every valid GID entry in one call.
    pub query_gid_table: Option<
        unsafe extern "C" fn(
            context: *mut IbvContext,
            entries: *mut IbvGidEntry,
            max_entries: usize,
            flags: u32,
            entry_size: usize,
        ) -> isize,
    >,
    /// `ibv_is_fork_initialized` (rdma-core ≥ 35).
    pub is_fork_initialized: Option<unsafe extern "C" fn() -> u32>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Why libibverbs could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// `dlopen` failed: the library is not installed (or not where the loader looks).
    NotFound { name: String, detail: String },
    /// The library loaded but lacks a function every libibverbs since 1.1 has.
    MissingSymbol { name: String, symbol: &'static str },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::NotFound { name, detail } => write!(
                f,
                "{name} was not found ({detail}); install rdma-core's libibverbs (Debian/Ubuntu: \
                 apt-get install libibverbs1 ibverbs-providers) to use RDMA hardware"
            ),
            LoadError::MissingSymbol { name, symbol } => {
                write!(
                    f,
                    "{name} has no `{symbol}`: it is not a usable libibverbs (rdma-core 17 or later needed)"
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

static LOADED: OnceLock<Result<Arc<Api>, LoadError>> = OnceLock::new();

impl Api {
    /// The process-wide libibverbs, loaded on first use (from [`LIBRARY_ENV`] if set, else
    /// [`LIBRARY_NAME`]). The outcome, success or failure, is remembered.
    pub fn get() -> Result<Arc<Api>, LoadError> {
        LOADED
            .get_or_init(|| {
                let name = std::env::var(LIBRARY_ENV).unwrap_or_else(|_| LIBRARY_NAME.to_string());
                Api::load(&name).map(Arc::new)
            })
            .clone()
    }

    /// Loads the library from `name` (a file name the dynamic loader searches for, or a path).
    pub fn load(name: &str) -> Result<Api, LoadError> {
        // SAFETY: loading libibverbs runs its ELF constructors, which only initialise the
        // library's own state (provider list, logging); it is the documented way to use it.
        let library = unsafe { libloading::Library::new(name) }
            .map_err(|err| LoadError::NotFound { name: name.to_string(), detail: err.to_string() })?;
        macro_rules! required {
            ($symbol:literal) => {{
                // SAFETY: the symbol is a function of libibverbs with exactly the signature of
                // the field it is stored in (checked against verbs.h by the declarations above);
                // the pointer is copied out and stays valid while `_library` is loaded.
                let symbol = unsafe { library.get(concat!($symbol, "\0").as_bytes()) };
                *symbol.map_err(|_| LoadError::MissingSymbol { name: name.to_string(), symbol: $symbol })?
            }};
        }
        macro_rules! optional {
            ($symbol:literal) => {{
                // SAFETY: as for `required!`; absence is allowed for these newer symbols.
                let symbol = unsafe { library.get(concat!($symbol, "\0").as_bytes()) };
                symbol.ok().map(|symbol| *symbol)
            }};
        }
        Ok(Api {
            path: name.to_string(),
            get_device_list: required!("ibv_get_device_list"),
            free_device_list: required!("ibv_free_device_list"),
            get_device_name: required!("ibv_get_device_name"),
            open_device: required!("ibv_open_device"),
            close_device: required!("ibv_close_device"),
            query_device: required!("ibv_query_device"),
            query_port: required!("ibv_query_port"),
            query_gid: required!("ibv_query_gid"),
            alloc_pd: required!("ibv_alloc_pd"),
            dealloc_pd: required!("ibv_dealloc_pd"),
            reg_mr: required!("ibv_reg_mr"),
            dereg_mr: required!("ibv_dereg_mr"),
            create_comp_channel: required!("ibv_create_comp_channel"),
            destroy_comp_channel: required!("ibv_destroy_comp_channel"),
            create_cq: required!("ibv_create_cq"),
            destroy_cq: required!("ibv_destroy_cq"),
            get_cq_event: required!("ibv_get_cq_event"),
            ack_cq_events: required!("ibv_ack_cq_events"),
            create_qp: required!("ibv_create_qp"),
            destroy_qp: required!("ibv_destroy_qp"),
            modify_qp: required!("ibv_modify_qp"),
            query_qp: required!("ibv_query_qp"),
            query_gid_table: optional!("_ibv_query_gid_table"),
            is_fork_initialized: optional!("ibv_is_fork_initialized"),
            _library: library,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_explained() {
        let err = Api::load("libibverbs-that-does-not-exist.so.9").expect_err("no such library");
        let text = err.to_string();
        assert!(text.contains("libibverbs-that-does-not-exist.so.9 was not found"), "{text}");
        assert!(text.contains("apt-get install libibverbs1"), "{text}");
    }

    #[test]
    fn a_library_without_verbs_is_refused() {
        // libc is loadable everywhere this crate runs but has no ibv_* functions.
        let err = Api::load("libc.so.6").expect_err("libc is not libibverbs");
        assert_eq!(err, LoadError::MissingSymbol { name: "libc.so.6".into(), symbol: "ibv_get_device_list" });
    }
}
