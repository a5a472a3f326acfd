//! [`IbvDevice`]: an open `ibv_context`, its limits, ports and GID tables, and the GID its
//! queue pairs send from.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};

use lightpath_verbs::{Device, DeviceAttr, Error, Gid, Mtu, PortAttr, PortState, QpState, Result};

use crate::cq::IbvCq;
use crate::error::{from_errno, from_rc};
use crate::ffi::library::{Api, IbvDevice as RawDevice};
use crate::ffi::types::{IbvContext, IbvDeviceAttr, IbvGid, IbvGidEntry, IbvPortAttr, LINK_LAYER_ETHERNET};
use crate::gid::{choose, dense_table, GidEntry, GidKind};
use crate::pd::IbvPd;

/// How a device is opened: which port its queue pairs use and which GID they send from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbvConfig {
    /// Port number (1-based); `None` means 1.
    pub port: Option<u8>,
    /// GID index to send from; `None` chooses automatically (see [`crate::gid`]).
    pub gid_index: Option<u32>,
}

/// An open RDMA device. Cloning gives another handle; the context is closed when the last
/// handle and the last object created from it are gone.
#[derive(Clone)]
pub struct IbvDevice {
    pub(crate) inner: Arc<ContextInner>,
}

/// What every object of a device shares.
pub(crate) struct ContextInner {
    pub(crate) api: Arc<Api>,
    pub(crate) ctx: *mut IbvContext,
    pub(crate) name: String,
    pub(crate) attr: IbvDeviceAttr,
    /// The port queue pairs use and the GID they send from.
    pub(crate) port: u8,
    pub(crate) source: GidEntry,
    pub(crate) link_layer: u8,
    /// What Lightpath tracks of every live queue pair, by number (see [`QpShared`]).
    pub(crate) qps: Mutex<HashMap<u32, Weak<QpShared>>>,
}

// SAFETY: an ibv_context is safe to use from any thread (libibverbs and its providers lock
// internally; rdma-core documents every verb as thread safe); the other fields are plain data
// or synchronised.
unsafe impl Send for ContextInner {}
// SAFETY: as above: shared use from several threads is what libibverbs supports.
unsafe impl Sync for ContextInner {}

/// What a queue pair shares with the completion queues it reports to.
#[derive(Debug)]
pub(crate) struct QpShared {
    /// Last known state (`ibv_qp_state` value): set by `modify`/`state`, and to ERR by a
    /// completion queue that sees an error completion of this queue pair (the device moves it
    /// there without telling anyone).
    pub(crate) state: AtomicU32,
    /// The connected peer's queue pair number (set at RTR), for receive completions whose
    /// device leaves `src_qp` empty (verbs fills it only for UD; rxe leaves it 0 for RC).
    pub(crate) dest_qpn: AtomicU32,
}

impl ContextInner {
    /// The shared record of queue pair `qpn`, if it is alive.
    pub(crate) fn qp(&self, qpn: u32) -> Option<std::sync::Arc<QpShared>> {
        self.qps.lock().unwrap_or_else(|p| p.into_inner()).get(&qpn).and_then(Weak::upgrade)
    }

    /// Marks queue pair `qpn` as being in ERR (after an error completion).
    pub(crate) fn note_error(&self, qpn: u32) {
        if let Some(qp) = self.qp(qpn) {
            qp.state.store(QpState::Err.to_raw(), Ordering::Relaxed);
        }
    }

    pub(crate) fn query_port_raw(&self, port_num: u8) -> Result<IbvPortAttr> {
        if port_num == 0 || port_num > self.attr.phys_port_cnt {
            return Err(Error::InvalidAttribute("port number: no such port on this device"));
        }
        let mut attr = IbvPortAttr::default();
        // SAFETY: `ctx` is open for as long as `self` lives; `attr` is a writable buffer at least
        // as large as the library's `struct ibv_port_attr` (see IbvPortAttr's spare room).
        let rc = unsafe { (self.api.query_port)(self.ctx, port_num, &mut attr) };
        if rc != 0 {
            return Err(from_rc("ibv_query_port", rc));
        }
        Ok(attr)
    }

    /// Every valid GID entry of `port_num`.
    pub(crate) fn gid_entries(&self, port_num: u8) -> Result<Vec<GidEntry>> {
        let port = self.query_port_raw(port_num)?;
        let table_len = u32::try_from(port.gid_tbl_len).unwrap_or(0);
        if let Some(query_table) = self.api.query_gid_table {
            let total: usize = (1..=self.attr.phys_port_cnt)
                .filter_map(|p| self.query_port_raw(p).ok())
                .map(|p| usize::try_from(p.gid_tbl_len).unwrap_or(0))
                .sum();
            let mut raw = vec![IbvGidEntry::default(); total.max(1)];
            // SAFETY: `raw` has room for `raw.len()` entries of the size passed; the context is
            // open.
            let count = unsafe {
                query_table(self.ctx, raw.as_mut_ptr(), raw.len(), 0, std::mem::size_of::<IbvGidEntry>())
            };
            if count >= 0 {
                let count = (count as usize).min(raw.len());
                return Ok(raw[..count]
                    .iter()
                    .filter(|e| e.port_num == u32::from(port_num) && e.gid.raw != [0; 16])
                    .map(|e| GidEntry {
                        index: e.gid_index,
                        gid: Gid(e.gid.raw),
                        kind: GidKind::from_raw(e.gid_type),
                    })
                    .collect());
            }
            // Older kernels lack the ioctl behind it: fall back to one entry at a time.
        }
        let mut entries = Vec::new();
        for index in 0..table_len.min(i32::MAX as u32) {
            let mut gid = IbvGid::default();
            // SAFETY: the context is open and `gid` is a writable 16-byte union.
            let rc = unsafe { (self.api.query_gid)(self.ctx, port_num, index as i32, &mut gid) };
            if rc != 0 || gid.raw == [0; 16] {
                continue;
            }
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{port_num}/gid_attrs/types/{index}",
                self.name
            ))
            .map(|text| GidKind::from_sysfs(&text))
            .unwrap_or(if port.link_layer == LINK_LAYER_ETHERNET {
                GidKind::Other(u32::MAX)
            } else {
                GidKind::Ib
            });
            entries.push(GidEntry { index, gid: Gid(gid.raw), kind });
        }
        Ok(entries)
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every object created from the context held an Arc to this inner value, so all
        // of them are destroyed already; the context is closed exactly once.
        unsafe { (self.api.close_device)(self.ctx) };
    }
}

impl IbvDevice {
    /// Opens the device `raw` (from the library's device list) with `config`.
    pub(crate) fn open_raw(api: Arc<Api>, raw: *mut RawDevice, config: IbvConfig) -> Result<Self> {
        // SAFETY: `raw` is an entry of a live device list; the name is a NUL-terminated string
        // owned by the device.
        let name = unsafe { CStr::from_ptr((api.get_device_name)(raw)) }.to_string_lossy().into_owned();
        // SAFETY: as above; opening a listed device is always allowed.
        let ctx = unsafe { (api.open_device)(raw) };
        if ctx.is_null() {
            return Err(from_errno("ibv_open_device"));
        }
        let mut attr = IbvDeviceAttr::default();
        // SAFETY: `ctx` was just opened; `attr` is a writable `struct ibv_device_attr`.
        let rc = unsafe { (api.query_device)(ctx, &mut attr) };
        if rc != 0 {
            // SAFETY: closing the context opened above, once.
            unsafe { (api.close_device)(ctx) };
            return Err(from_rc("ibv_query_device", rc));
        }
        let port = config.port.unwrap_or(1);
        let mut inner = ContextInner {
            api,
            ctx,
            name,
            attr,
            port,
            source: GidEntry { index: 0, gid: Gid::ZERO, kind: GidKind::Ib },
            link_layer: 0,
            qps: Mutex::new(HashMap::new()),
        };
        // From here on, dropping `inner` closes the context.
        let port_attr = inner.query_port_raw(port).map_err(|_| {
            Error::Unavailable(format!(
                "{}: no port {port} (the device has {} port(s), numbered from 1)",
                inner.name, inner.attr.phys_port_cnt
            ))
        })?;
        inner.link_layer = port_attr.link_layer;
        let entries = inner.gid_entries(port)?;
        inner.source = match config.gid_index {
            Some(index) => {
                let table_len = u32::try_from(port_attr.gid_tbl_len).unwrap_or(0);
                if index >= table_len {
                    return Err(Error::Unavailable(format!(
                        "{} port {port}: GID index {index} is out of range (the table has {table_len} entries, \
                         0 to {}); leave the GID index out to choose the RoCE v2 IPv4 GID automatically",
                        inner.name,
                        table_len.saturating_sub(1)
                    )));
                }
                entries.iter().find(|e| e.index == index).copied().ok_or_else(|| {
                    Error::Unavailable(format!(
                        "{} port {port}: GID index {index} is empty; valid indexes: {}",
                        inner.name,
                        entries.iter().map(|e| e.index.to_string()).collect::<Vec<_>>().join(", ")
                    ))
                })?
            }
            None => choose(&entries, port_attr.link_layer == LINK_LAYER_ETHERNET)
                .map_err(|why| Error::Unavailable(format!("{} port {port}: {why}", inner.name)))?,
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The port queue pairs of this device use.
    pub fn port(&self) -> u8 {
        self.inner.port
    }

    /// The GID table entry queue pairs send from (chosen automatically unless configured).
    pub fn source_gid(&self) -> GidEntry {
        self.inner.source
    }

    /// Every valid GID entry of `port_num`, with its kind.
    pub fn gid_entries(&self, port_num: u8) -> Result<Vec<GidEntry>> {
        self.inner.gid_entries(port_num)
    }

    /// Whether the port's link layer is Ethernet (RoCE) rather than InfiniBand.
    pub fn is_ethernet(&self) -> bool {
        self.inner.link_layer == LINK_LAYER_ETHERNET
    }

    /// The firmware version string the device reports.
    pub fn firmware(&self) -> String {
        let fw = &self.inner.attr.fw_ver;
        let end = fw.iter().position(|&b| b == 0).unwrap_or(fw.len());
        String::from_utf8_lossy(&fw[..end]).into_owned()
    }
}

impl std::fmt::Debug for IbvDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvDevice")
            .field("name", &self.inner.name)
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.source.index)
            .field("gid", &self.inner.source.gid)
            .finish()
    }
}

fn clamp(value: i32) -> u32 {
    u32::try_from(value).unwrap_or(0)
}

impl Device for IbvDevice {
    type Pd = IbvPd;
    type Cq = IbvCq;

    fn name(&self) -> &str {
        &self.inner.name
    }

    fn query(&self) -> Result<DeviceAttr> {
        let attr = &self.inner.attr;
        Ok(DeviceAttr {
            phys_port_cnt: attr.phys_port_cnt,
            max_qp: clamp(attr.max_qp),
            max_qp_wr: clamp(attr.max_qp_wr),
            max_sge: clamp(attr.max_sge),
            max_cq: clamp(attr.max_cq),
            max_cqe: clamp(attr.max_cqe),
            max_mr: clamp(attr.max_mr),
            max_mr_size: attr.max_mr_size,
            max_pd: clamp(attr.max_pd),
            max_qp_rd_atom: clamp(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: clamp(attr.max_qp_init_rd_atom),
            // libibverbs does not report a device-wide inline limit; QpCaps from create_qp do.
            max_inline_data: 0,
            atomics: attr.atomic_cap != 0,
        })
    }

    fn query_port(&self, port_num: u8) -> Result<PortAttr> {
        let raw = self.inner.query_port_raw(port_num)?;
        let unknown = |what: &'static str| {
            Error::Unavailable(format!("{}: device reported an unknown {what}", self.inner.name))
        };
        Ok(PortAttr {
            state: PortState::from_raw(raw.state).ok_or_else(|| unknown("port state"))?,
            max_mtu: Mtu::from_ibv(raw.max_mtu).ok_or_else(|| unknown("maximum MTU"))?,
            active_mtu: Mtu::from_ibv(raw.active_mtu).ok_or_else(|| unknown("active MTU"))?,
            gid_tbl_len: clamp(raw.gid_tbl_len),
        })
    }

    fn gids(&self, port_num: u8) -> Result<Vec<Gid>> {
        Ok(dense_table(&self.inner.gid_entries(port_num)?))
    }

    fn alloc_pd(&self) -> Result<IbvPd> {
        IbvPd::new(Arc::clone(&self.inner))
    }

    fn create_cq(&self, min_entries: u32) -> Result<IbvCq> {
        IbvCq::new(Arc::clone(&self.inner), min_entries)
    }
}
