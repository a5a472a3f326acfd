//! The native half of the `lightpath` Python package (`lightpath._lightpath`): a
//! [`Communicator`](lightpath_collectives::Communicator) for Python, whose collectives work on
//! any C-contiguous object with the buffer protocol (numpy arrays, `bytearray`, `memoryview`,
//! `array.array`) or with DLPack on the CPU (torch tensors).
//!
//! Why a layer of its own: the collectives crate is safe Rust over slices; Python hands out
//! raw memory through the buffer protocol or DLPack capsules, which need FFI
//! (`PyObject_GetBuffer`, `PyCapsule_*`, DLPack's structs) and a translation of the element
//! format into the collectives' element types. This
//! crate does only that, plus releasing the GIL while a call communicates and turning the
//! collectives' errors into the Python exceptions of `lightpath/errors.py` (which carry the
//! rank at fault, the operation and its sequence number). The Python API around it (`init`,
//! the torch backend) lives in `lightpath/*.py`.
//!
//! Built as an abi3 extension for CPython >= 3.11 (the first stable ABI with the buffer
//! protocol) with maturin (`pip install ./python`).

use lightpath_collectives::bootstrap::{JobEnv, Launcher};
use lightpath_collectives::store::StoreServer as RustStoreServer;
use lightpath_collectives::{Collective, Communicator as RustCommunicator, Config, DType, Error, ReduceOp};
use pyo3::exceptions::{PyBufferError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::CStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod nonblocking;
use nonblocking::{Completer, RawBuffers, Request};

/// DLPack's C structs (dlpack.h, ABI version 0.x as torch 1.13 and numpy 1.24 export it).
mod dlpack {
    use std::ffi::c_void;

    /// `kDLCPU`.
    pub const CPU: i32 = 1;

    #[repr(C)]
    pub struct Device {
        pub device_type: i32,
        pub device_id: i32,
    }

    #[repr(C)]
    pub struct DataType {
        pub code: u8,
        pub bits: u8,
        pub lanes: u16,
    }

    #[repr(C)]
    pub struct Tensor {
        pub data: *mut c_void,
        pub device: Device,
        pub ndim: i32,
        pub dtype: DataType,
        pub shape: *mut i64,
        pub strides: *mut i64,
        pub byte_offset: u64,
    }

    #[repr(C)]
    pub struct ManagedTensor {
        pub dl_tensor: Tensor,
        pub manager_ctx: *mut c_void,
        pub deleter: Option<unsafe extern "C" fn(*mut ManagedTensor)>,
    }
}

/// Who keeps a [`View`]'s memory alive until the view is dropped.
enum Owner {
    /// A buffer-protocol export (`PyObject_GetBuffer`), released with `PyBuffer_Release`.
    Buffer(Box<ffi::Py_buffer>),
    /// A DLPack tensor taken from its capsule (renamed `used_dltensor`, so this view owns
    /// it), released with its deleter.
    DLPack(*mut dlpack::ManagedTensor),
}

/// The memory of one argument of a call: C-contiguous bytes, their element format and item
/// size, and the export that keeps them alive (released on drop).
///
/// Not `Send` (it holds raw pointers), so it never crosses into a GIL-released closure:
/// only the byte slices borrowed from it do, and the export outlives them.
struct View {
    owner: Owner,
    ptr: *mut u8,
    len: usize,
    itemsize: usize,
    /// A struct-module format (`"f"`, `"<i8"`...), or `"bf16"` for DLPack's bfloat16.
    format: String,
    writable: bool,
}

impl View {
    /// Exports `obj`'s memory, which must be C-contiguous (and writable when asked): through
    /// the buffer protocol, else (torch tensors, ...) through `__dlpack__` on the CPU.
    fn export(obj: &Bound<'_, PyAny>, what: &str, writable: bool) -> PyResult<View> {
        match Self::export_buffer(obj, writable) {
            Ok(v) => Ok(v),
            Err(cause) if obj.hasattr("__dlpack__").unwrap_or(false) => {
                Self::export_dlpack(obj, what).inspect_err(|e| e.set_cause(obj.py(), Some(cause)))
            }
            Err(cause) => {
                let kind = if writable { "a writable, C-contiguous" } else { "a C-contiguous" };
                let err = PyBufferError::new_err(format!(
                    "{what} must be {kind} object with the buffer protocol or DLPack (numpy array, torch CPU tensor, bytearray, memoryview, ...)"
                ));
                err.set_cause(obj.py(), Some(cause));
                Err(err)
            }
        }
    }

    fn export_buffer(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<View> {
        let mut raw = Box::new(ffi::Py_buffer::new());
        let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
        if writable {
            flags |= ffi::PyBUF_WRITABLE;
        }
        // SAFETY: `obj` is a live object (a `Bound` proves the GIL is held) and `raw` points
        // to a `Py_buffer` owned by this function; on success the exporter fills it in and
        // keeps the memory alive until `PyBuffer_Release` (in `Drop`).
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        let format = if raw.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-null `format` from a successful export with `PyBUF_FORMAT` is a
            // NUL-terminated string that lives as long as the export.
            unsafe { CStr::from_ptr(raw.format) }.to_string_lossy().into_owned()
        };
        let len = usize::try_from(raw.len).unwrap_or(0);
        let itemsize = usize::try_from(raw.itemsize).unwrap_or(1).max(1);
        let ptr = raw.buf as *mut u8;
        Ok(View { owner: Owner::Buffer(raw), ptr, len, itemsize, format, writable })
    }

    fn export_dlpack(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<View> {
        let capsule = obj.call_method0("__dlpack__").map_err(|cause| {
            let err = PyBufferError::new_err(format!("{what}: __dlpack__ failed: {cause}"));
            err.set_cause(obj.py(), Some(cause));
            err
        })?;
        const NAME: &CStr = c"dltensor";
        const USED: &CStr = c"used_dltensor";
        // SAFETY: `capsule` is a live object; `PyCapsule_IsValid` accepts any object and
        // checks that it is a capsule with this name.
        if unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), NAME.as_ptr()) } != 1 {
            return Err(PyTypeError::new_err(format!(
                "{what}: __dlpack__ did not return a \"dltensor\" capsule"
            )));
        }
        // SAFETY: the capsule is valid with this name (checked above), so its pointer is the
        // producer's `DLManagedTensor`. Renaming it to "used_dltensor" is the DLPack
        // protocol's hand-over: the capsule's destructor will no longer free it, and this
        // view calls its deleter on drop.
        let managed = unsafe {
            let m = ffi::PyCapsule_GetPointer(capsule.as_ptr(), NAME.as_ptr()) as *mut dlpack::ManagedTensor;
            if m.is_null() || ffi::PyCapsule_SetName(capsule.as_ptr(), USED.as_ptr()) != 0 {
                return Err(PyErr::fetch(obj.py()));
            }
            m
        };
        // From here on `view` owns the tensor (its drop calls the deleter), also on error.
        let mut view = View {
            owner: Owner::DLPack(managed),
            ptr: std::ptr::null_mut(),
            len: 0,
            itemsize: 1,
            format: String::new(),
            writable: true,
        };
        // SAFETY: `managed` is the producer's live `DLManagedTensor` (owned by `view` until
        // its deleter runs); `shape` and `strides` (if not null) hold `ndim` entries each, as
        // the DLPack ABI requires.
        let (t, shape, strides) = unsafe {
            let t = &(*managed).dl_tensor;
            let ndim = usize::try_from(t.ndim).unwrap_or(0);
            let shape = if ndim == 0 || t.shape.is_null() {
                &[][..]
            } else {
                std::slice::from_raw_parts(t.shape, ndim)
            };
            let strides = if ndim == 0 || t.strides.is_null() {
                None
            } else {
                Some(std::slice::from_raw_parts(t.strides, ndim))
            };
            (t, shape, strides)
        };
        if t.device.device_type != dlpack::CPU {
            return Err(PyTypeError::new_err(format!(
                "{what}: a DLPack tensor on device type {} (lightpath takes CPU memory)",
                t.device.device_type
            )));
        }
        if t.dtype.lanes != 1 || t.dtype.bits == 0 || t.dtype.bits % 8 != 0 {
            return Err(PyTypeError::new_err(format!(
                "{what}: DLPack elements of {} bits x {} lanes are not supported",
                t.dtype.bits, t.dtype.lanes
            )));
        }
        let itemsize = usize::from(t.dtype.bits / 8);
        let mut numel: usize = 1;
        let mut expected: i64 = 1;
        for (d, &n) in shape.iter().enumerate().rev() {
            let n_usize =
                usize::try_from(n).map_err(|_| PyValueError::new_err(format!("{what}: shape {shape:?}")))?;
            numel = numel
                .checked_mul(n_usize)
                .ok_or_else(|| PyValueError::new_err(format!("{what}: shape {shape:?}")))?;
            if let Some(st) = strides {
                if n > 1 && st[d] != expected {
                    return Err(PyBufferError::new_err(format!(
                        "{what} must be C-contiguous (DLPack shape {shape:?}, strides {st:?}); call .contiguous()"
                    )));
                }
            }
            expected = expected.saturating_mul(n.max(1));
        }
        let len =
            numel.checked_mul(itemsize).ok_or_else(|| PyValueError::new_err(format!("{what}: too large")))?;
        let format = match (t.dtype.code, t.dtype.bits) {
            (0, 8) => "b",
            (0, 16) => "h",
            (0, 32) => "i",
            (0, 64) => "q",
            (1, 8) => "B",
            (1, 16) => "H",
            (1, 32) => "I",
            (1, 64) => "Q",
            (2, 16) => "e",
            (2, 32) => "f",
            (2, 64) => "d",
            (4, 16) => "bf16",
            (6, 8) => "?",
            _ => "x",
        };
        view.ptr = if len == 0 || t.data.is_null() {
            std::ptr::null_mut()
        } else {
            (t.data as *mut u8).wrapping_add(usize::try_from(t.byte_offset).unwrap_or(0))
        };
        view.len = len;
        view.itemsize = itemsize;
        view.format = format.to_string();
        Ok(view)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn itemsize(&self) -> usize {
        self.itemsize
    }

    fn format(&self) -> String {
        self.format.clone()
    }

    fn range(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.len
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 || self.ptr.is_null() {
            return &[];
        }
        // SAFETY: a C-contiguous export's memory (`ptr`, `len` bytes: a buffer export's
        // `buf`/`len`, or a DLPack tensor's data + byte offset, numel x item size, checked
        // contiguous) stays valid until the export is released, which `Drop` does only after
        // this borrow of `self` ends. Another Python thread writing to the same memory
        // meanwhile is the caller's race, as with every extension that releases the GIL
        // over array memory.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        debug_assert!(self.writable);
        if self.len == 0 || self.ptr.is_null() {
            return &mut [];
        }
        // SAFETY: as in `bytes`; buffer exports were requested with `PyBUF_WRITABLE` (DLPack
        // carries no read-only flag: its producers hand out writable memory), and the callers
        // check that no other view borrowed for the same call overlaps this memory, so the
        // mutable slice is the only Rust reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        match &mut self.owner {
            // SAFETY: `raw` was filled by a successful `PyObject_GetBuffer` and is released
            // once. Views live only inside methods called with the GIL held and are dropped
            // after any GIL-released section ends, so the GIL is held here.
            Owner::Buffer(raw) => unsafe { ffi::PyBuffer_Release(&mut **raw) },
            Owner::DLPack(managed) => {
                // SAFETY: this view took the tensor from its capsule (renamed, so nobody
                // else frees it); DLPack's contract is that the consumer calls `deleter`
                // once, with the tensor itself.
                unsafe {
                    if let Some(deleter) = (**managed).deleter {
                        deleter(*managed);
                    }
                }
            }
        }
    }
}

fn overlaps(a: &View, b: &View) -> bool {
    let (a, b) = (a.range(), b.range());
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// The element type for reductions: `dtype` when given (a collectives name such as `"bf16"`
/// or a numpy name such as `"bfloat16"`), else from the buffer's format.
fn reduce_dtype(view: &View, dtype: Option<&str>) -> PyResult<DType> {
    let d = match dtype {
        Some(name) => parse_dtype(name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "dtype {name:?}: use one of f32 f64 f16 bf16 i32 i64 u8 (or float32, float64, float16, bfloat16, int32, int64, uint8)"
            ))
        })?,
        None => dtype_of_format(&view.format(), view.itemsize())?,
    };
    if !view.len().is_multiple_of(d.size()) {
        return Err(PyValueError::new_err(format!(
            "the buffer's {} bytes are not a whole number of {d} elements",
            view.len()
        )));
    }
    Ok(d)
}

fn parse_dtype(name: &str) -> Option<DType> {
    DType::parse(name).or(match name {
        "float32" => Some(DType::F32),
        "float64" => Some(DType::F64),
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        "int32" => Some(DType::I32),
        "int64" => Some(DType::I64),
        "uint8" => Some(DType::U8),
        _ => None,
    })
}

/// Maps a struct-module format (`"<f"`, `"d"`, `"l"`, ...) and item size to an element type.
fn dtype_of_format(format: &str, itemsize: usize) -> PyResult<DType> {
    let code = match format.strip_prefix(['@', '=', '<']) {
        Some(rest) => rest,
        None if format.starts_with(['>', '!']) => {
            return Err(PyTypeError::new_err(format!(
                "big-endian elements (format {format:?}) cannot be reduced on this machine"
            )))
        }
        None => format,
    };
    let d = match (code, itemsize) {
        ("f", 4) => Some(DType::F32),
        ("d", 8) => Some(DType::F64),
        ("e", 2) => Some(DType::F16),
        ("bf16", 2) => Some(DType::BF16), // DLPack's bfloat16 (no struct-module code exists)
        ("B", 1) => Some(DType::U8),
        ("b" | "h" | "i" | "l" | "q" | "n", 4) => Some(DType::I32),
        ("b" | "h" | "i" | "l" | "q" | "n", 8) => Some(DType::I64),
        _ => None,
    };
    d.ok_or_else(|| {
        PyTypeError::new_err(format!(
            "elements of format {format:?} ({itemsize} bytes) cannot be reduced: reductions support \
             float32, float64, float16, int32, int64 and uint8 (bfloat16 with dtype=\"bf16\" on a 2-byte view)"
        ))
    })
}

fn parse_op(op: &str) -> PyResult<ReduceOp> {
    match op.to_ascii_lowercase().as_str() {
        "sum" => Ok(ReduceOp::Sum),
        "prod" | "product" => Ok(ReduceOp::Prod),
        "min" => Ok(ReduceOp::Min),
        "max" => Ok(ReduceOp::Max),
        "avg" | "mean" => Ok(ReduceOp::Avg),
        _ => Err(PyValueError::new_err(format!("op {op:?}: use sum, prod, min, max or avg"))),
    }
}

/// The collectives' error as an exception of `lightpath.errors`, carrying rank, op and seq.
fn to_pyerr(py: Python<'_>, e: &Error) -> PyErr {
    let (class, reporter) = match e {
        Error::PeerFailed { .. } => ("PeerFailedError", None),
        Error::Timeout { .. } => ("CollectiveTimeoutError", None),
        Error::Aborted { reporter, .. } => ("AbortedError", Some(*reporter)),
        Error::Mismatch { .. } => ("MismatchError", None),
        Error::InvalidArgument { .. } => ("InvalidArgumentError", None),
        Error::Bootstrap { .. } => ("BootstrapError", None),
        _ => ("LightpathError", None),
    };
    exception(py, class, &e.to_string(), e.rank(), e.op(), e.seq(), reporter)
}

fn exception(
    py: Python<'_>,
    class: &str,
    message: &str,
    rank: Option<usize>,
    op: Option<&str>,
    seq: Option<u64>,
    reporter: Option<usize>,
) -> PyErr {
    let made = py
        .import("lightpath.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((message, rank, op, seq, reporter)));
    match made {
        Ok(value) => PyErr::from_value(value),
        Err(err) => PyRuntimeError::new_err(format!(
            "{message} (lightpath.errors.{class} could not be raised: {err})"
        )),
    }
}

/// A group of ranks and the collective calls among them.
///
/// Every rank must make the same calls in the same order. Buffers are C-contiguous objects
/// with the buffer protocol or DLPack (CPU); outputs must be writable. Reductions take the
/// element type from the buffer (float32/64/16, bfloat16, int32/64, uint8) or from
/// ``dtype``; the other calls move bytes and take any element type. The GIL is released
/// while a call communicates.
#[pyclass(frozen, name = "Communicator", module = "lightpath._lightpath")]
struct Communicator {
    inner: Mutex<Option<Arc<RustCommunicator>>>,
    /// The thread that finishes nonblocking calls nobody waits for, from the first one on.
    completer: Mutex<Option<Completer>>,
    rank: usize,
    size: usize,
}

/// A call ready to run: what, over which element type, and the exports of its input and
/// output (absent where the call reads or writes nothing, or works in place).
struct Prepared {
    what: Collective,
    dtype: DType,
    input: Option<View>,
    output: Option<View>,
}

impl Prepared {
    /// A call over no buffers.
    fn bare(what: Collective) -> Prepared {
        Prepared { what, dtype: DType::U8, input: None, output: None }
    }
}

impl Communicator {
    fn wrap(c: RustCommunicator) -> Communicator {
        Communicator {
            rank: c.rank(),
            size: c.size(),
            inner: Mutex::new(Some(Arc::new(c))),
            completer: Mutex::new(None),
        }
    }

    fn get(&self, py: Python<'_>, op: &str) -> PyResult<Arc<RustCommunicator>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| {
            exception(
                py,
                "LightpathError",
                &format!("{op}: the communicator is closed"),
                None,
                Some(op),
                None,
                None,
            )
        })
    }

    /// Runs a call with the GIL released.
    fn run(&self, py: Python<'_>, call: Prepared) -> PyResult<()> {
        let comm = self.get(py, call.what.name())?;
        let Prepared { what, dtype, input, mut output } = call;
        let input = input.as_ref().map(View::bytes).unwrap_or(&[]);
        let output = match output.as_mut() {
            Some(v) => v.bytes_mut(),
            None => &mut [],
        };
        py.detach(|| comm.execute(&what, dtype, input, output)).map_err(|e| to_pyerr(py, &e))
    }

    /// Starts a call on the call thread (see `nonblocking`); with `blocking`, runs it here
    /// instead, as the blocking methods do, then calls `callback` with None (a failure raises).
    fn start(
        &self,
        py: Python<'_>,
        call: Prepared,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        if blocking {
            self.run(py, call)?;
            if let Some(callback) = callback {
                callback.call1(py, (py.None(),))?;
            }
            return Ok(None);
        }
        let comm = self.get(py, call.what.name())?;
        let completer = {
            let mut slot = self.completer.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(Completer::start().map_err(|e| {
                    PyRuntimeError::new_err(format!("starting lightpath's completion thread: {e}"))
                })?);
            }
            slot.as_ref().map(Completer::sender).expect("started above")
        };
        let Prepared { what, dtype, input, mut output } = call;
        let raw = RawBuffers::new(input.as_ref(), output.as_mut());
        let exports = input.into_iter().chain(output).collect();
        nonblocking::launch(exports, callback, completer, move |then| {
            comm.iexecute_then(what, dtype, raw, move |outcome| then(outcome.map(drop)))
        })
        .map(Some)
        .map_err(|e| to_pyerr(py, &e))
    }

    fn prep_allreduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: &str,
        dtype: Option<&str>,
    ) -> PyResult<Prepared> {
        let op = parse_op(op)?;
        let comm = self.get(py, "allreduce")?;
        let (inp, out) = match out {
            Some(o) => Self::pair(Some(buf), o)?,
            None => (None, View::export(buf, "the buffer", true)?),
        };
        let d = reduce_dtype(&out, dtype)?;
        if let Some(i) = &inp {
            same_elements(i, &out, dtype)?;
        }
        let count = out.len() / d.size();
        let algo = comm.allreduce_algorithm(out.len());
        let what = Collective::Allreduce { count, op, algo, in_place: inp.is_none() };
        Ok(Prepared { what, dtype: d, input: inp, output: Some(out) })
    }

    fn prep_reduce(buf: &Bound<'_, PyAny>, root: usize, op: &str, dtype: Option<&str>) -> PyResult<Prepared> {
        let op = parse_op(op)?;
        let v = View::export(buf, "the buffer", true)?;
        let d = reduce_dtype(&v, dtype)?;
        let what = Collective::Reduce { count: v.len() / d.size(), op, root };
        Ok(Prepared { what, dtype: d, input: None, output: Some(v) })
    }

    fn prep_broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<Prepared> {
        let comm = self.get(py, "broadcast")?;
        let v = View::export(buf, "the buffer", true)?;
        let algo = comm.broadcast_algorithm(v.len());
        let what = Collective::Broadcast { count: v.len(), root, algo };
        Ok(Prepared { what, dtype: DType::U8, input: None, output: Some(v) })
    }

    fn prep_allgather(&self, buf: Option<&Bound<'_, PyAny>>, out: &Bound<'_, PyAny>) -> PyResult<Prepared> {
        let (inp, out) = Self::pair(buf, out)?;
        let block = match &inp {
            Some(i) => i.len(),
            None => {
                if !out.len().is_multiple_of(self.size) {
                    return Err(PyValueError::new_err(format!(
                        "allgather in place: the output's {} bytes do not split into {} equal blocks",
                        out.len(),
                        self.size
                    )));
                }
                out.len() / self.size
            }
        };
        let what = Collective::Allgather { counts: vec![block; self.size], in_place: inp.is_none() };
        Ok(Prepared { what, dtype: DType::U8, input: inp, output: Some(out) })
    }

    fn prep_allgatherv(
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        counts: &[usize],
    ) -> PyResult<Prepared> {
        let (inp, out) = Self::both(buf, out)?;
        let counts = counts_in_bytes(counts, out.itemsize(), "allgatherv counts")?;
        let what = Collective::Allgather { counts, in_place: false };
        Ok(Prepared { what, dtype: DType::U8, input: Some(inp), output: Some(out) })
    }

    fn prep_reduce_scatter(
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        op: &str,
        dtype: Option<&str>,
    ) -> PyResult<Prepared> {
        let op = parse_op(op)?;
        let (inp, out) = Self::both(buf, out)?;
        let d = reduce_dtype(&out, dtype)?;
        same_elements(&inp, &out, dtype)?;
        let what = Collective::ReduceScatter { count: out.len() / d.size(), op };
        Ok(Prepared { what, dtype: d, input: Some(inp), output: Some(out) })
    }

    fn prep_alltoall(&self, buf: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<Prepared> {
        let (inp, out) = Self::both(buf, out)?;
        let p = self.size;
        if !inp.len().is_multiple_of(p) || !out.len().is_multiple_of(p) {
            return Err(PyValueError::new_err(format!(
                "alltoall: {} input and {} output bytes do not split into {p} equal blocks",
                inp.len(),
                out.len()
            )));
        }
        let what =
            Collective::Alltoall { send_counts: vec![inp.len() / p; p], recv_counts: vec![out.len() / p; p] };
        Ok(Prepared { what, dtype: DType::U8, input: Some(inp), output: Some(out) })
    }

    fn prep_alltoallv(
        buf: &Bound<'_, PyAny>,
        send_counts: &[usize],
        out: &Bound<'_, PyAny>,
        recv_counts: &[usize],
    ) -> PyResult<Prepared> {
        let (inp, out) = Self::both(buf, out)?;
        let what = Collective::Alltoall {
            send_counts: counts_in_bytes(send_counts, inp.itemsize(), "alltoallv send_counts")?,
            recv_counts: counts_in_bytes(recv_counts, out.itemsize(), "alltoallv recv_counts")?,
        };
        Ok(Prepared { what, dtype: DType::U8, input: Some(inp), output: Some(out) })
    }

    fn prep_send(buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<Prepared> {
        let v = View::export(buf, "the buffer", false)?;
        let what = Collective::Send { count: v.len(), peer };
        Ok(Prepared { what, dtype: DType::U8, input: Some(v), output: None })
    }

    fn prep_recv(buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<Prepared> {
        let v = View::export(buf, "the buffer", true)?;
        let what = Collective::Recv { count: v.len(), peer };
        Ok(Prepared { what, dtype: DType::U8, input: None, output: Some(v) })
    }

    /// Exports an input and a distinct output; `None` for the input means in place.
    fn pair(input: Option<&Bound<'_, PyAny>>, output: &Bound<'_, PyAny>) -> PyResult<(Option<View>, View)> {
        match input {
            Some(i) => Self::both(i, output).map(|(i, o)| (Some(i), o)),
            None => Ok((None, View::export(output, "the output", true)?)),
        }
    }

    /// Exports an input and an output that must not overlap.
    fn both(input: &Bound<'_, PyAny>, output: &Bound<'_, PyAny>) -> PyResult<(View, View)> {
        let out = View::export(output, "the output", true)?;
        let inp = View::export(input, "the input", false)?;
        if overlaps(&inp, &out) {
            return Err(PyValueError::new_err(
                "the input and the output overlap: pass the buffer alone for an in-place call",
            ));
        }
        Ok((inp, out))
    }
}

/// For out-of-place reductions: the input's elements must be the output's (else the bytes
/// would be reinterpreted).
fn same_elements(inp: &View, out: &View, dtype: Option<&str>) -> PyResult<()> {
    if dtype.is_some() {
        return Ok(());
    }
    let (i, o) =
        (dtype_of_format(&inp.format(), inp.itemsize())?, dtype_of_format(&out.format(), out.itemsize())?);
    if i != o {
        return Err(PyTypeError::new_err(format!(
            "the input's elements ({i}) differ from the output's ({o})"
        )));
    }
    Ok(())
}

fn counts_in_bytes(counts: &[usize], itemsize: usize, what: &str) -> PyResult<Vec<usize>> {
    counts
        .iter()
        .map(|c| c.checked_mul(itemsize))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| PyValueError::new_err(format!("{what} overflow")))
}

#[pymethods]
impl Communicator {
    /// Joins the job that the launcher's environment describes (torchrun, mpirun, srun or
    /// ``lightpath launch``); ``lightpath.init()`` calls this.
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<Communicator> {
        py.detach(RustCommunicator::from_env).map(Communicator::wrap).map_err(|e| to_pyerr(py, &e))
    }

    /// Joins a job of ``size`` ranks as ``rank``, meeting the others at the rendezvous store
    /// ``store`` (``"host:port"``, a TCPStore-protocol server such as :class:`StoreServer`),
    /// under the key prefix ``prefix``. ``timeout`` (seconds) overrides how long a call waits
    /// for a peer that makes no progress; ``init_timeout`` how long joining may take. Other
    /// settings come from the ``LIGHTPATH_COLL_*`` variables.
    #[staticmethod]
    #[pyo3(signature = (rank, size, store, prefix = "", timeout = None, init_timeout = None))]
    fn join(
        py: Python<'_>,
        rank: usize,
        size: usize,
        store: String,
        prefix: &str,
        timeout: Option<f64>,
        init_timeout: Option<f64>,
    ) -> PyResult<Communicator> {
        if size == 0 || rank >= size {
            return Err(PyValueError::new_err(format!("rank {rank} of {size}: need 0 <= rank < size")));
        }
        let seconds = |name: &str, v: Option<f64>| -> PyResult<Option<Duration>> {
            v.map(|s| {
                Duration::try_from_secs_f64(s).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
                    PyValueError::new_err(format!("{name}={s}: give a positive number of seconds"))
                })
            })
            .transpose()
        };
        let timeout = seconds("timeout", timeout)?;
        let init_timeout = seconds("init_timeout", init_timeout)?;
        let mut config = Config::from_env().map_err(|e| to_pyerr(py, &e))?;
        if let Some(t) = timeout {
            config.timeout = t;
        }
        if let Some(t) = init_timeout {
            config.init_timeout = t;
        }
        let env = JobEnv {
            launcher: Launcher::Lightpath,
            rank,
            size,
            local_rank: rank,
            local_size: size,
            store,
            serve_store: false,
            key_prefix: prefix.to_string(),
        };
        py.detach(|| RustCommunicator::init(&env, config))
            .map(Communicator::wrap)
            .map_err(|e| to_pyerr(py, &e))
    }

    /// This process's rank in the group.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// World rank of each member of the group, in group order.
    #[getter]
    fn world_ranks(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        Ok(self.get(py, "world_ranks")?.world_ranks().to_vec())
    }

    /// How this rank reaches each world rank (``None`` for itself), e.g. ``"rdma/shm"``.
    fn transports(&self, py: Python<'_>) -> PyResult<Vec<Option<String>>> {
        Ok(self.get(py, "transports")?.transports())
    }

    /// Whether :meth:`close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// ``out`` = ``op`` over every rank's ``buf``; in place on ``buf`` when ``out`` is None.
    /// ``op``: ``"sum"``, ``"prod"``, ``"min"``, ``"max"`` or ``"avg"``.
    #[pyo3(signature = (buf, out = None, op = "sum", dtype = None))]
    fn allreduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: &str,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        self.run(py, self.prep_allreduce(py, buf, out, op, dtype)?)
    }

    /// :meth:`allreduce`, nonblocking: returns a :class:`Request` at once. ``callback``, if
    /// given, is called with None (or the call's exception) once the call has ended, on a
    /// thread of Lightpath's or in :meth:`Request.wait`, with the GIL. ``blocking=True`` runs
    /// the call before returning None instead (a failure raises; the callback is called with
    /// None): for a caller that decides per call whether it will wait at once. The same
    /// holds for every ``i*`` method.
    #[pyo3(signature = (buf, out = None, op = "sum", dtype = None, callback = None, blocking = false))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn iallreduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: &str,
        dtype: Option<&str>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, self.prep_allreduce(py, buf, out, op, dtype)?, callback, blocking)
    }

    /// The root's ``buf`` = ``op`` over every rank's ``buf``; other ranks' buffers are left
    /// unchanged.
    #[pyo3(signature = (buf, root = 0, op = "sum", dtype = None))]
    fn reduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
        op: &str,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        self.run(py, Self::prep_reduce(buf, root, op, dtype)?)
    }

    /// :meth:`reduce`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, root = 0, op = "sum", dtype = None, callback = None, blocking = false))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn ireduce(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
        op: &str,
        dtype: Option<&str>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_reduce(buf, root, op, dtype)?, callback, blocking)
    }

    /// Every rank's ``buf`` = the root's.
    #[pyo3(signature = (buf, root = 0))]
    fn broadcast(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, root: usize) -> PyResult<()> {
        self.run(py, self.prep_broadcast(py, buf, root)?)
    }

    /// :meth:`broadcast`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, root = 0, callback = None, blocking = false))]
    fn ibroadcast(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, self.prep_broadcast(py, buf, root)?, callback, blocking)
    }

    /// ``out`` = every rank's ``buf`` concatenated in rank order (``size`` times the bytes of
    /// ``buf``). With ``buf`` None it is in place: this rank's block is already in ``out``.
    fn allgather(
        &self,
        py: Python<'_>,
        buf: Option<&Bound<'_, PyAny>>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.run(py, self.prep_allgather(buf, out)?)
    }

    /// :meth:`allgather`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, out, callback = None, blocking = false))]
    fn iallgather(
        &self,
        py: Python<'_>,
        buf: Option<&Bound<'_, PyAny>>,
        out: &Bound<'_, PyAny>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, self.prep_allgather(buf, out)?, callback, blocking)
    }

    /// Allgather with a count per rank: ``counts[r]`` elements (of ``out``'s item size) from
    /// rank ``r``, concatenated in rank order into ``out``.
    fn allgatherv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        counts: Vec<usize>,
    ) -> PyResult<()> {
        self.run(py, Self::prep_allgatherv(buf, out, &counts)?)
    }

    /// :meth:`allgatherv`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, out, counts, callback = None, blocking = false))]
    fn iallgatherv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        counts: Vec<usize>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_allgatherv(buf, out, &counts)?, callback, blocking)
    }

    /// ``out`` = ``op`` over every rank's block ``rank`` of ``buf`` (``buf`` holds ``size``
    /// blocks the size of ``out``).
    #[pyo3(signature = (buf, out, op = "sum", dtype = None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        op: &str,
        dtype: Option<&str>,
    ) -> PyResult<()> {
        self.run(py, Self::prep_reduce_scatter(buf, out, op, dtype)?)
    }

    /// :meth:`reduce_scatter`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, out, op = "sum", dtype = None, callback = None, blocking = false))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn ireduce_scatter(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        op: &str,
        dtype: Option<&str>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_reduce_scatter(buf, out, op, dtype)?, callback, blocking)
    }

    /// Block ``j`` of ``buf`` goes to rank ``j``; block ``i`` of ``out`` comes from rank
    /// ``i`` (``size`` equal blocks each).
    fn alltoall(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
        self.run(py, self.prep_alltoall(buf, out)?)
    }

    /// :meth:`alltoall`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, out, callback = None, blocking = false))]
    fn ialltoall(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, self.prep_alltoall(buf, out)?, callback, blocking)
    }

    /// Alltoall with counts (elements of each buffer's item size) per peer, blocks
    /// contiguous in rank order.
    fn alltoallv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        out: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
    ) -> PyResult<()> {
        self.run(py, Self::prep_alltoallv(buf, &send_counts, out, &recv_counts)?)
    }

    /// :meth:`alltoallv`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, send_counts, out, recv_counts, callback = None, blocking = false))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one each
    fn ialltoallv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        out: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_alltoallv(buf, &send_counts, out, &recv_counts)?, callback, blocking)
    }

    /// Returns once every rank of the group has entered.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, Prepared::bare(Collective::Barrier))
    }

    /// :meth:`barrier`, nonblocking (see :meth:`iallreduce`): the request ends once every
    /// rank has entered.
    #[pyo3(signature = (callback = None, blocking = false))]
    fn ibarrier(
        &self,
        py: Python<'_>,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Prepared::bare(Collective::Barrier), callback, blocking)
    }

    /// Sends ``buf`` to ``peer``, which must :meth:`recv` the same number of bytes.
    fn send(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        self.run(py, Self::prep_send(buf, peer)?)
    }

    /// :meth:`send`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, peer, callback = None, blocking = false))]
    fn isend(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_send(buf, peer)?, callback, blocking)
    }

    /// Receives ``len(buf)`` bytes from ``peer`` into ``buf``.
    fn recv(&self, py: Python<'_>, buf: &Bound<'_, PyAny>, peer: usize) -> PyResult<()> {
        self.run(py, Self::prep_recv(buf, peer)?)
    }

    /// :meth:`recv`, nonblocking (see :meth:`iallreduce`).
    #[pyo3(signature = (buf, peer, callback = None, blocking = false))]
    fn irecv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        callback: Option<Py<PyAny>>,
        blocking: bool,
    ) -> PyResult<Option<Request>> {
        self.start(py, Self::prep_recv(buf, peer)?, callback, blocking)
    }

    /// Splits the group: ranks passing the same ``color`` form a new communicator, ordered
    /// by ``key`` then rank; ``color=None`` opts out and returns None. Collective.
    #[pyo3(signature = (color, key = 0))]
    fn split(&self, py: Python<'_>, color: Option<u32>, key: i64) -> PyResult<Option<Communicator>> {
        let comm = self.get(py, "split")?;
        py.detach(|| comm.split(color, key)).map(|c| c.map(Communicator::wrap)).map_err(|e| to_pyerr(py, &e))
    }

    /// Aborts the job: every rank's current or next call raises ``AbortedError`` naming this
    /// rank.
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let comm = self.get(py, "abort")?;
        py.detach(|| comm.abort(reason));
        Ok(())
    }

    /// Leaves the job cleanly (flushes what this rank sent and tells the peers); later calls
    /// raise. Also done by ``with`` and, for ``lightpath.init()``'s communicator, at exit.
    /// Nonblocking calls still running end first (their callbacks run).
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let completer = self.completer.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Without the GIL: the completion thread needs it for the calls still running, and
        // stops once they have ended.
        py.detach(move || {
            drop(taken);
            if let Some(c) = completer {
                c.stop();
            }
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("<lightpath.Communicator rank {} of {}{state}>", self.rank, self.size)
    }
}

/// A rendezvous store (the TCPStore protocol) served by this process on ``host:port``
/// (port 0: a free one) until closed; other ranks pass its address to
/// :meth:`Communicator.join`.
#[pyclass(frozen, name = "StoreServer", module = "lightpath._lightpath")]
struct StoreServer {
    server: Mutex<Option<RustStoreServer>>,
    port: u16,
}

#[pymethods]
impl StoreServer {
    #[new]
    #[pyo3(signature = (host = "0.0.0.0", port = 0))]
    fn new(py: Python<'_>, host: &str, port: u16) -> PyResult<StoreServer> {
        let server = RustStoreServer::bind((host, port)).map_err(|e| {
            exception(
                py,
                "BootstrapError",
                &format!("serving a store on {host}:{port}: {e}"),
                None,
                None,
                None,
                None,
            )
        })?;
        Ok(StoreServer { port: server.local_addr().port(), server: Mutex::new(Some(server)) })
    }

    /// The port the store listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Stops serving.
    fn close(&self, py: Python<'_>) {
        let taken = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(move || drop(taken));
    }
}

/// Completion threads of communicators dropped without `close` (a torch process group
/// destroyed with calls in flight, say): they still finish those calls, which needs the GIL,
/// so they are kept here and joined by [`_finish_pending`] at interpreter exit, before Python
/// finalizes (a thread that takes the GIL after that is ended by the interpreter mid-call).
static ORPHANED: Mutex<Vec<Completer>> = Mutex::new(Vec::new());

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Some(completer) = self.completer.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            ORPHANED.lock().unwrap_or_else(|e| e.into_inner()).push(completer);
        }
    }
}

/// Waits, without the GIL, for the nonblocking calls of communicators dropped without
/// `close` to end and their callbacks to run (registered with `atexit` by the package).
#[pyfunction]
fn _finish_pending(py: Python<'_>) {
    let orphaned = std::mem::take(&mut *ORPHANED.lock().unwrap_or_else(|e| e.into_inner()));
    py.detach(move || {
        for completer in orphaned {
            completer.stop();
        }
    });
}

#[pymodule]
fn _lightpath(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_finish_pending, m)?)?;
    m.add_class::<Communicator>()?;
    m.add_class::<StoreServer>()?;
    m.add_class::<Request>()?;
    Ok(())
}
