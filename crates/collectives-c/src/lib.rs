//! The C ABI of `lightpath-collectives`: `include/lightpath_coll.h` and the shared library
//! `liblightpath_coll.so` that implements it, so that C and C++ programs (and anything with a
//! C FFI) run Lightpath's collectives without Rust.
//!
//! Why a crate of its own: the collectives crate is safe Rust over slices and forbids unsafe
//! code; a C caller hands over raw pointers, element counts and integer codes. This layer only
//! translates: it checks every pointer, count and code before it builds a slice or an enum (a
//! code C passes is never transmuted), calls [`Communicator::execute`] (or
//! [`Communicator::iexecute`] for the nonblocking forms), and turns the result
//! into a status code, keeping the error's description per thread (`lp_last_error`). Nothing
//! unwinds into C: a panic becomes `LP_ERR_INTERNAL`.
//!
//! The header documents the calls; the names mirror the Rust API (`lp_allreduce` is
//! [`Communicator::allreduce`], and so on).
//!
//! # Nonblocking calls
//!
//! `lp_iallreduce`, `lp_ibroadcast`, `lp_iallgather`, `lp_ireduce_scatter`, `lp_ialltoall`
//! and `lp_ibarrier` check their arguments exactly as the blocking forms do (same code), then
//! start the call with [`Communicator::iexecute`], the Rust side's one nonblocking machinery:
//! each call runs on the communicator's call thread in the turn it took when it was issued
//! (one thread per process, started by the first nonblocking call), so calls
//! run in the order of issue, blocking ones included. The caller's buffers are lent to the
//! call without a copy: a private [`CallBuffers`] value holds their pointers and lengths and
//! rebuilds the slices on the call thread; the header's contract (buffers valid and
//! untouched until the request completes) is what makes that sound.
//!
//! An `lp_request *` is a handle, not an address: a slot of a process-wide table and that
//! slot's generation. `lp_wait` and `lp_test` look it up (a NULL, stale or made-up handle is
//! refused, never dereferenced), take the [`Request`] out and join it on the calling thread,
//! so that the call's error lands in that thread's `lp_last_error`. `lp_comm_destroy` first
//! waits for the calls already issued ([`Communicator::wait_issued`]), so that nothing uses a
//! caller's buffer after it returns; the requests stay valid.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use lightpath_collectives::{CallBuffers, Collective, Communicator, DType, Error, ReduceOp, Request};

/// `LP_OK`.
pub const LP_OK: c_int = 0;
/// `LP_ERR_INVALID_ARGUMENT`: nothing was sent.
pub const LP_ERR_INVALID_ARGUMENT: c_int = 1;
/// `LP_ERR_PEER_FAILED`.
pub const LP_ERR_PEER_FAILED: c_int = 2;
/// `LP_ERR_TIMEOUT`.
pub const LP_ERR_TIMEOUT: c_int = 3;
/// `LP_ERR_ABORTED`.
pub const LP_ERR_ABORTED: c_int = 4;
/// `LP_ERR_MISMATCH`.
pub const LP_ERR_MISMATCH: c_int = 5;
/// `LP_ERR_BOOTSTRAP`.
pub const LP_ERR_BOOTSTRAP: c_int = 6;
/// `LP_ERR_INTERNAL`: a bug, reported instead of unwinding into C.
pub const LP_ERR_INTERNAL: c_int = 7;

/// A communicator as C holds it (`lp_comm *`).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct lp_comm {
    inner: Communicator,
}

/// What the last failed call on a thread said.
struct LastError {
    message: CString,
    rank: Option<usize>,
    seq: Option<u64>,
}

thread_local! {
    static LAST_ERROR: RefCell<Option<LastError>> = const { RefCell::new(None) };
}

/// A failure on its way to C: its status and what `lp_last_error` will say.
struct Failure {
    status: c_int,
    error: Error,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        let status = match &error {
            Error::PeerFailed { .. } => LP_ERR_PEER_FAILED,
            Error::Timeout { .. } => LP_ERR_TIMEOUT,
            Error::Aborted { .. } => LP_ERR_ABORTED,
            Error::Mismatch { .. } => LP_ERR_MISMATCH,
            Error::InvalidArgument { .. } => LP_ERR_INVALID_ARGUMENT,
            Error::Bootstrap { .. } => LP_ERR_BOOTSTRAP,
            _ => LP_ERR_INTERNAL,
        };
        Failure { status, error }
    }
}

fn invalid(op: &'static str, detail: impl Into<String>) -> Failure {
    Failure::from(Error::InvalidArgument { op, detail: detail.into() })
}

fn remember(message: String, rank: Option<usize>, seq: Option<u64>) {
    // A description never holds a NUL; should one slip in, the text stops there.
    let message = CString::new(message)
        .unwrap_or_else(|e| CString::new(&e.into_vec()[..0]).expect("an empty string has no NUL"));
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = Some(LastError { message, rank, seq }));
}

/// Runs `call`, turning its failure (or panic) into a status and the thread's last error.
fn guarded(op: &'static str, call: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(())) => LP_OK,
        Ok(Err(Failure { status, error })) => {
            remember(error.to_string(), error.rank(), error.seq());
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            remember(format!("{op}: internal error (a bug in Lightpath): {what}"), None, None);
            LP_ERR_INTERNAL
        }
    }
}

/// The communicator behind a C pointer.
///
/// # Safety
/// `comm` is null or a pointer `lp_comm_init` / `lp_comm_split` returned and
/// `lp_comm_destroy` has not freed.
unsafe fn comm_ref<'a>(comm: *const lp_comm, op: &'static str) -> Result<&'a Communicator, Failure> {
    // SAFETY: the caller's contract: null or a live communicator of ours.
    unsafe { comm.as_ref() }.map(|c| &c.inner).ok_or_else(|| invalid(op, "the communicator is NULL"))
}

fn dtype_from(code: c_int, op: &'static str) -> Result<DType, Failure> {
    Ok(match code {
        0 => DType::F32,
        1 => DType::F64,
        2 => DType::F16,
        3 => DType::BF16,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::U8,
        _ => return Err(invalid(op, format!("unknown data type {code} (LP_F32 ... LP_U8 are 0 ... 6)"))),
    })
}

fn op_from(code: c_int, op: &'static str) -> Result<ReduceOp, Failure> {
    Ok(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Min,
        3 => ReduceOp::Max,
        4 => ReduceOp::Avg,
        _ => return Err(invalid(op, format!("unknown reduction {code} (LP_SUM ... LP_AVG are 0 ... 4)"))),
    })
}

fn rank_from(code: c_int, what: &str, comm: &Communicator, op: &'static str) -> Result<usize, Failure> {
    usize::try_from(code).ok().filter(|&r| r < comm.size()).ok_or_else(|| {
        invalid(op, format!("{what} {code} is not a rank of this communicator (size {})", comm.size()))
    })
}

/// Bytes of `count` elements of `dtype`.
fn bytes_of(count: usize, dtype: DType, op: &'static str) -> Result<usize, Failure> {
    count
        .checked_mul(dtype.size())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| invalid(op, format!("{count} elements of {dtype} do not fit in memory")))
}

/// The counts of a C array of `len` entries.
///
/// # Safety
/// `counts` is null or points to `len` readable `size_t`s.
unsafe fn counts_from(
    counts: *const usize,
    len: usize,
    what: &str,
    op: &'static str,
) -> Result<Vec<usize>, Failure> {
    if counts.is_null() {
        return Err(invalid(op, format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller promises `len` entries (one per rank).
    Ok(unsafe { std::slice::from_raw_parts(counts, len) }.to_vec())
}

fn sum_of(counts: &[usize], op: &'static str) -> Result<usize, Failure> {
    counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).ok_or_else(|| invalid(op, "the counts overflow"))
}

/// A buffer C passes to be read.
///
/// # Safety
/// `ptr` is null or valid for reads of `len` bytes for the call, and not written meanwhile.
unsafe fn input<'a>(
    ptr: *const c_void,
    len: usize,
    what: &str,
    op: &'static str,
) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(invalid(op, format!("{what} is NULL but holds {len} bytes")));
    }
    // SAFETY: non-null, and the caller promises `len` readable bytes for the call.
    Ok(unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) })
}

/// A buffer C passes to be written.
///
/// # Safety
/// `ptr` is null or valid for reads and writes of `len` bytes for the call, and not accessed
/// otherwise meanwhile.
unsafe fn output<'a>(
    ptr: *mut c_void,
    len: usize,
    what: &str,
    op: &'static str,
) -> Result<&'a mut [u8], Failure> {
    if len == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(invalid(op, format!("{what} is NULL but holds {len} bytes")));
    }
    // SAFETY: non-null, and the caller promises `len` writable bytes, used by nobody else.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) })
}

/// Refuses an input and an output that share memory (a Rust slice and a mutable slice may
/// not alias; in-place forms are asked for with NULL).
fn disjoint(
    input: (*const c_void, usize),
    output: (*mut c_void, usize),
    op: &'static str,
) -> Result<(), Failure> {
    let (a, alen) = (input.0 as usize, input.1);
    let (b, blen) = (output.0 as usize, output.1);
    if alen == 0 || blen == 0 || a.saturating_add(alen) <= b || b.saturating_add(blen) <= a {
        return Ok(());
    }
    Err(invalid(op, "the send and receive buffers overlap (pass NULL as sendbuf for the in-place form)"))
}

/// Joins the job described by the environment (see the header).
///
/// # Safety
/// `comm` is null or points to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_init(comm: *mut *mut lp_comm) -> c_int {
    guarded("init", || {
        if comm.is_null() {
            return Err(invalid("init", "the result pointer is NULL"));
        }
        let inner = Communicator::from_env()?;
        let boxed = Box::into_raw(Box::new(lp_comm { inner }));
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { comm.write(boxed) };
        Ok(())
    })
}

/// This rank in `comm`; -1 for NULL.
///
/// # Safety
/// As for every call: `comm` is null or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_rank(comm: *const lp_comm) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { comm.as_ref() }.map_or(-1, |c| c_int::try_from(c.inner.rank()).unwrap_or(c_int::MAX))
}

/// The number of ranks in `comm`; -1 for NULL.
///
/// # Safety
/// `comm` is null or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_size(comm: *const lp_comm) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { comm.as_ref() }.map_or(-1, |c| c_int::try_from(c.inner.size()).unwrap_or(c_int::MAX))
}

/// Splits `comm` by `color` (negative: no part), ordered by `key`.
///
/// # Safety
/// `comm` is null or a live communicator; `out` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_split(
    comm: *const lp_comm,
    color: c_int,
    key: i64,
    out: *mut *mut lp_comm,
) -> c_int {
    guarded("split", || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, "split") }?;
        if out.is_null() {
            return Err(invalid("split", "the result pointer is NULL"));
        }
        let color = u32::try_from(color).ok();
        let made = c
            .split(color, key)?
            .map_or(std::ptr::null_mut(), |inner| Box::into_raw(Box::new(lp_comm { inner })));
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { out.write(made) };
        Ok(())
    })
}

/// Aborts the job from this rank.
///
/// # Safety
/// `comm` is null or a live communicator; `reason` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_abort(comm: *const lp_comm, reason: *const c_char) {
    let _ = guarded("abort", || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, "abort") }?;
        let reason = if reason.is_null() {
            "aborted by the application".into()
        } else {
            // SAFETY: non-null and NUL-terminated, as the caller promises.
            unsafe { CStr::from_ptr(reason) }.to_string_lossy()
        };
        c.abort(&reason);
        Ok(())
    });
}

/// Frees a communicator, after its pending nonblocking calls have finished.
///
/// # Safety
/// `comm` is null or a live communicator, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn lp_comm_destroy(comm: *mut lp_comm) {
    if comm.is_null() {
        return;
    }
    let _ = guarded("destroy", || {
        // SAFETY: a pointer Box::into_raw made, freed once (the caller's contract).
        let comm = unsafe { Box::from_raw(comm) };
        // Pending requests finish first (each completes or fails within the timeout), so
        // that no call uses the caller's buffers once this returns; their requests stay
        // valid for lp_wait / lp_test, which then return at once.
        comm.inner.wait_issued();
        drop(comm);
        Ok(())
    });
}

/// Runs `what` on byte buffers after the checks common to every call.
fn run(
    comm: &Communicator,
    what: &Collective,
    dtype: DType,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), Failure> {
    comm.execute(what, dtype, input, output).map_err(Failure::from)
}

/// A call whose arguments have been checked: what to run, over which bytes.
struct Call<'a> {
    what: Collective,
    dtype: DType,
    input: &'a [u8],
    output: &'a mut [u8],
}

impl Call<'_> {
    /// Runs the call now (a blocking call).
    fn run(self, comm: &Communicator) -> Result<(), Failure> {
        run(comm, &self.what, self.dtype, self.input, self.output)
    }

    /// Starts the call as a nonblocking one and stores its handle in `req`.
    ///
    /// # Safety
    /// The buffers stay valid, and are not written (the output neither read) by anybody else,
    /// until the request is completed by `lp_wait` / `lp_test` (the header's contract for
    /// nonblocking calls): the call keeps using them after this returns.
    unsafe fn start(self, comm: &Communicator, req: RequestOut) -> Result<(), Failure> {
        // SAFETY: the caller's contract, passed on.
        let lent = unsafe { Lent::new(self.input, self.output) };
        let slot = requests().reserve(self.what.name())?;
        match comm.iexecute(self.what, self.dtype, lent) {
            Ok(request) => {
                let handle = requests().fill(slot, request);
                // SAFETY: `RequestOut` holds a non-null pointer the caller promises writable.
                unsafe { req.0.write(handle) };
                Ok(())
            }
            Err(e) => {
                requests().release(slot);
                Err(e.into())
            }
        }
    }
}

/// The buffers a nonblocking call of C's uses: the caller's memory, lent without a copy.
#[derive(Debug)]
struct Lent {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
}

impl Lent {
    /// # Safety
    /// Both buffers stay valid, and nobody else writes them (or reads `output`), until the
    /// call that gets this value has ended (its request is completed).
    unsafe fn new(input: &[u8], output: &mut [u8]) -> Lent {
        Lent {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
        }
    }
}

// SAFETY: the pointers are the C caller's buffers, which `Lent::new`'s contract keeps valid
// and unshared for the whole call, whichever thread runs it; only that thread uses them.
unsafe impl Send for Lent {}

impl CallBuffers for Lent {
    fn buffers(&mut self) -> (&[u8], &mut [u8]) {
        // SAFETY: the pointers and lengths came from slices (non-null and aligned, empty ones
        // included) that `Lent::new`'s contract keeps valid and unshared while the call runs,
        // which is when `buffers` is called; input and output were checked disjoint.
        unsafe {
            (
                std::slice::from_raw_parts(self.input, self.input_len),
                std::slice::from_raw_parts_mut(self.output, self.output_len),
            )
        }
    }
}

/// A nonblocking request as C holds it (`lp_request *`): an opaque handle, never a pointer
/// to memory. It names a slot of the process's request table and that slot's generation,
/// so a request already completed (or never made) is recognised and refused instead of
/// being dereferenced.
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct lp_request {
    _opaque: [u8; 0],
}

/// Bits of a handle that hold the slot (plus one, so that no handle is NULL); the rest hold
/// the slot's generation, which changes each time the slot is freed.
const SLOT_BITS: u32 = 24;
const SLOT_MASK: usize = (1 << SLOT_BITS) - 1;
const GENERATION_MASK: usize = usize::MAX >> SLOT_BITS;

#[derive(Debug, Default)]
struct Slot {
    generation: usize,
    /// `None` while free, or reserved for a call being started.
    request: Option<Request<Lent>>,
}

/// The outstanding requests of this process.
#[derive(Debug, Default)]
struct Requests {
    slots: Vec<Slot>,
    free: Vec<usize>,
}

static REQUESTS: Mutex<Requests> = Mutex::new(Requests { slots: Vec::new(), free: Vec::new() });

fn requests() -> std::sync::MutexGuard<'static, Requests> {
    REQUESTS.lock().unwrap_or_else(|e| e.into_inner())
}

impl Requests {
    /// Reserves a slot for a call about to start.
    fn reserve(&mut self, op: &'static str) -> Result<usize, Failure> {
        let index = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < SLOT_MASK => {
                self.slots.push(Slot::default());
                self.slots.len() - 1
            }
            None => return Err(invalid(op, format!("{SLOT_MASK} requests are outstanding already"))),
        };
        Ok(index)
    }

    fn fill(&mut self, index: usize, request: Request<Lent>) -> *mut lp_request {
        let slot = &mut self.slots[index];
        slot.request = Some(request);
        let handle = ((slot.generation & GENERATION_MASK) << SLOT_BITS) | (index + 1);
        // An opaque handle, not an address (see `lp_request`).
        handle as *mut lp_request
    }

    fn release(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.generation = slot.generation.wrapping_add(1);
        slot.request = None;
        self.free.push(index);
    }

    /// The slot a handle names, if it holds a pending request.
    fn find(&self, handle: *mut lp_request, op: &'static str) -> Result<usize, Failure> {
        if handle.is_null() {
            return Err(invalid(op, "the request is NULL"));
        }
        let h = handle as usize;
        let index = (h & SLOT_MASK).wrapping_sub(1);
        match self.slots.get(index) {
            Some(slot) if slot.request.is_some() && (slot.generation & GENERATION_MASK) == h >> SLOT_BITS => {
                Ok(index)
            }
            _ => Err(invalid(
                op,
                format!(
                    "{handle:p} is not a pending request (completed and freed already by lp_wait or \
                     lp_test, being completed on another thread, or never made)"
                ),
            )),
        }
    }

    /// Takes a pending request out of the table, freeing its handle.
    fn take(&mut self, index: usize) -> Request<Lent> {
        let request = self.slots[index].request.take().expect("find checked it");
        self.release(index);
        request
    }
}

/// Where a nonblocking call stores its request: checked non-null and set to NULL first, so
/// that it is NULL whenever the call fails.
struct RequestOut(*mut *mut lp_request);

/// # Safety
/// `req` is null or writable storage for one pointer.
unsafe fn request_out(req: *mut *mut lp_request, op: &'static str) -> Result<RequestOut, Failure> {
    if req.is_null() {
        return Err(invalid(op, "the request pointer is NULL"));
    }
    // SAFETY: non-null, and the caller promises it is writable.
    unsafe { req.write(std::ptr::null_mut()) };
    Ok(RequestOut(req))
}

/// The arguments of `lp_allreduce` and `lp_iallreduce`, checked.
///
/// # Safety
/// `comm` is null or live; the buffers hold `count` elements of `dtype` (or are null), for
/// as long as the returned call is used.
unsafe fn allreduce_call<'a>(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    name: &'static str,
) -> Result<(&'a Communicator, Call<'a>), Failure> {
    // SAFETY: the caller's contract.
    let c = unsafe { comm_ref(comm, name) }?;
    let (d, reduce) = (dtype_from(dtype, name)?, op_from(op, name)?);
    let len = bytes_of(count, d, name)?;
    let in_place = sendbuf.is_null() || sendbuf == recvbuf.cast_const();
    if !in_place {
        disjoint((sendbuf, len), (recvbuf, len), name)?;
    }
    // SAFETY: the caller promises `count` elements in each buffer.
    let input = if in_place { &[][..] } else { unsafe { input(sendbuf, len, "sendbuf", name) }? };
    // SAFETY: as above.
    let output = unsafe { output(recvbuf, len, "recvbuf", name) }?;
    let algo = c.allreduce_algorithm(len);
    Ok((
        c,
        Call { what: Collective::Allreduce { count, op: reduce, algo, in_place }, dtype: d, input, output },
    ))
}

/// `recvbuf` = op over every rank's `sendbuf` (in place when `sendbuf` is NULL or `recvbuf`).
///
/// # Safety
/// `comm` is null or live; the buffers hold `count` elements of `dtype` (or are null).
#[no_mangle]
pub unsafe extern "C" fn lp_allreduce(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    const OP: &str = "allreduce";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { allreduce_call(comm, sendbuf, recvbuf, count, dtype, op, OP) }?;
        call.run(c)
    })
}

/// Nonblocking `lp_allreduce`.
///
/// # Safety
/// As `lp_allreduce`, with the buffers valid and untouched until the request completes;
/// `req` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_iallreduce(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    req: *mut *mut lp_request,
) -> c_int {
    const OP: &str = "iallreduce";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { allreduce_call(comm, sendbuf, recvbuf, count, dtype, op, OP) }?;
        // SAFETY: the caller keeps the buffers for the request (the header's contract).
        unsafe { call.start(c, req) }
    })
}

/// The root's `buf` = op over every rank's `buf`.
///
/// # Safety
/// `comm` is null or live; `buf` holds `count` elements of `dtype` (or is null).
#[no_mangle]
pub unsafe extern "C" fn lp_reduce(
    comm: *const lp_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
) -> c_int {
    const OP: &str = "reduce";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let (d, reduce) = (dtype_from(dtype, OP)?, op_from(op, OP)?);
        let root = rank_from(root, "root", c, OP)?;
        let len = bytes_of(count, d, OP)?;
        // SAFETY: the caller promises `count` elements.
        let buf = unsafe { output(buf, len, "buf", OP) }?;
        run(c, &Collective::Reduce { count, op: reduce, root }, d, &[], buf)
    })
}

/// Every rank's `buf` = the root's.
///
/// # Safety
/// `comm` is null or live; `buf` holds `count` elements of `dtype` (or is null).
#[no_mangle]
pub unsafe extern "C" fn lp_broadcast(
    comm: *const lp_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
) -> c_int {
    const OP: &str = "broadcast";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { broadcast_call(comm, buf, count, dtype, root, OP) }?;
        call.run(c)
    })
}

/// The arguments of `lp_broadcast` and `lp_ibroadcast`, checked.
///
/// # Safety
/// `comm` is null or live; `buf` holds `count` elements of `dtype` (or is null), for as long
/// as the returned call is used.
unsafe fn broadcast_call<'a>(
    comm: *const lp_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    name: &'static str,
) -> Result<(&'a Communicator, Call<'a>), Failure> {
    // SAFETY: the caller's contract.
    let c = unsafe { comm_ref(comm, name) }?;
    let d = dtype_from(dtype, name)?;
    let root = rank_from(root, "root", c, name)?;
    let len = bytes_of(count, d, name)?;
    // SAFETY: the caller promises `count` elements.
    let buf = unsafe { output(buf, len, "buf", name) }?;
    let algo = c.broadcast_algorithm(len);
    // Bytes are bytes: broadcast moves them as such.
    let what = Collective::Broadcast { count: len, root, algo };
    Ok((c, Call { what, dtype: DType::U8, input: &[], output: buf }))
}

/// Nonblocking `lp_broadcast`.
///
/// # Safety
/// As `lp_broadcast`, with `buf` valid and untouched until the request completes; `req` is
/// null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_ibroadcast(
    comm: *const lp_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    req: *mut *mut lp_request,
) -> c_int {
    const OP: &str = "ibroadcast";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { broadcast_call(comm, buf, count, dtype, root, OP) }?;
        // SAFETY: the caller keeps the buffer for the request (the header's contract).
        unsafe { call.start(c, req) }
    })
}

/// Gathers blocks of `counts[r]` elements from every rank `r` into `recvbuf`.
///
/// # Safety
/// `comm` live; `sendbuf` holds `counts[rank]` elements or is null (in place); `recvbuf` holds
/// the sum of `counts`.
unsafe fn allgather_counts<'a>(
    c: &Communicator,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    counts: Vec<usize>,
    d: DType,
    op: &'static str,
) -> Result<Call<'a>, Failure> {
    let total = bytes_of(sum_of(&counts, op)?, d, op)?;
    let own = bytes_of(counts[c.rank()], d, op)?;
    let in_place = sendbuf.is_null();
    if !in_place {
        disjoint((sendbuf, own), (recvbuf, total), op)?;
    }
    // SAFETY: the caller promises the sizes.
    let input = if in_place { &[][..] } else { unsafe { input(sendbuf, own, "sendbuf", op) }? };
    // SAFETY: as above.
    let output = unsafe { output(recvbuf, total, "recvbuf", op) }?;
    let es = d.size();
    let counts = counts.iter().map(|n| n * es).collect();
    Ok(Call { what: Collective::Allgather { counts, in_place }, dtype: DType::U8, input, output })
}

/// `recvbuf` = every rank's `count` elements, in rank order (in place when `sendbuf` is NULL).
///
/// # Safety
/// `comm` is null or live; `sendbuf` holds `count` elements (or is null), `recvbuf`
/// `size * count`.
#[no_mangle]
pub unsafe extern "C" fn lp_allgather(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
) -> c_int {
    const OP: &str = "allgather";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        // SAFETY: the caller promises the sizes.
        unsafe { allgather_counts(c, sendbuf, recvbuf, vec![count; c.size()], d, OP) }?.run(c)
    })
}

/// Nonblocking `lp_allgather`.
///
/// # Safety
/// As `lp_allgather`, with the buffers valid and untouched until the request completes;
/// `req` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_iallgather(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    req: *mut *mut lp_request,
) -> c_int {
    const OP: &str = "iallgather";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        // SAFETY: the caller promises the sizes.
        let call = unsafe { allgather_counts(c, sendbuf, recvbuf, vec![count; c.size()], d, OP) }?;
        // SAFETY: the caller keeps the buffers for the request (the header's contract).
        unsafe { call.start(c, req) }
    })
}

/// As `lp_allgather` with `counts[r]` elements from rank `r`.
///
/// # Safety
/// `comm` is null or live; `counts` has `size` entries; the buffers hold what they say.
#[no_mangle]
pub unsafe extern "C" fn lp_allgatherv(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    counts: *const usize,
    dtype: c_int,
) -> c_int {
    const OP: &str = "allgatherv";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        // SAFETY: the caller promises `size` entries.
        let counts = unsafe { counts_from(counts, c.size(), "counts", OP) }?;
        // SAFETY: the caller promises the sizes.
        unsafe { allgather_counts(c, sendbuf, recvbuf, counts, d, OP) }?.run(c)
    })
}

/// `recvbuf` (`recvcount`) = op over every rank's block `rank` of `sendbuf`.
///
/// # Safety
/// `comm` is null or live; `sendbuf` holds `size * recvcount` elements, `recvbuf` `recvcount`.
#[no_mangle]
pub unsafe extern "C" fn lp_reduce_scatter(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    const OP: &str = "reduce_scatter";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { reduce_scatter_call(comm, sendbuf, recvbuf, recvcount, dtype, op, OP) }?;
        call.run(c)
    })
}

/// The arguments of `lp_reduce_scatter` and `lp_ireduce_scatter`, checked.
///
/// # Safety
/// `comm` is null or live; `sendbuf` holds `size * recvcount` elements, `recvbuf`
/// `recvcount`, for as long as the returned call is used.
unsafe fn reduce_scatter_call<'a>(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
    name: &'static str,
) -> Result<(&'a Communicator, Call<'a>), Failure> {
    // SAFETY: the caller's contract.
    let c = unsafe { comm_ref(comm, name) }?;
    let (d, reduce) = (dtype_from(dtype, name)?, op_from(op, name)?);
    let out_len = bytes_of(recvcount, d, name)?;
    let in_len =
        out_len.checked_mul(c.size()).ok_or_else(|| invalid(name, "the send buffer's size overflows"))?;
    disjoint((sendbuf, in_len), (recvbuf, out_len), name)?;
    // SAFETY: the caller promises the sizes.
    let input = unsafe { input(sendbuf, in_len, "sendbuf", name) }?;
    // SAFETY: as above.
    let output = unsafe { output(recvbuf, out_len, "recvbuf", name) }?;
    Ok((
        c,
        Call { what: Collective::ReduceScatter { count: recvcount, op: reduce }, dtype: d, input, output },
    ))
}

/// Nonblocking `lp_reduce_scatter`.
///
/// # Safety
/// As `lp_reduce_scatter`, with the buffers valid and untouched until the request completes;
/// `req` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_ireduce_scatter(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
    req: *mut *mut lp_request,
) -> c_int {
    const OP: &str = "ireduce_scatter";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let (c, call) = unsafe { reduce_scatter_call(comm, sendbuf, recvbuf, recvcount, dtype, op, OP) }?;
        // SAFETY: the caller keeps the buffers for the request (the header's contract).
        unsafe { call.start(c, req) }
    })
}

/// Runs an alltoall with element counts per peer.
///
/// # Safety
/// `sendbuf` and `recvbuf` hold the sums of their counts.
unsafe fn alltoall_counts<'a>(
    sendbuf: *const c_void,
    send_counts: Vec<usize>,
    recvbuf: *mut c_void,
    recv_counts: Vec<usize>,
    d: DType,
    op: &'static str,
) -> Result<Call<'a>, Failure> {
    let in_len = bytes_of(sum_of(&send_counts, op)?, d, op)?;
    let out_len = bytes_of(sum_of(&recv_counts, op)?, d, op)?;
    disjoint((sendbuf, in_len), (recvbuf, out_len), op)?;
    // SAFETY: the caller promises the sizes.
    let input = unsafe { input(sendbuf, in_len, "sendbuf", op) }?;
    // SAFETY: as above.
    let output = unsafe { output(recvbuf, out_len, "recvbuf", op) }?;
    Ok(Call { what: Collective::Alltoall { send_counts, recv_counts }, dtype: d, input, output })
}

/// Block `r` of `sendbuf` to rank `r`, block `r` of `recvbuf` from it (`count` each).
///
/// # Safety
/// `comm` is null or live; each buffer holds `size * count` elements.
#[no_mangle]
pub unsafe extern "C" fn lp_alltoall(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
) -> c_int {
    const OP: &str = "alltoall";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        let p = c.size();
        // SAFETY: the caller promises the sizes.
        unsafe { alltoall_counts(sendbuf, vec![count; p], recvbuf, vec![count; p], d, OP) }?.run(c)
    })
}

/// Nonblocking `lp_alltoall`.
///
/// # Safety
/// As `lp_alltoall`, with the buffers valid and untouched until the request completes; `req`
/// is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_ialltoall(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: c_int,
    req: *mut *mut lp_request,
) -> c_int {
    const OP: &str = "ialltoall";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        let p = c.size();
        // SAFETY: the caller promises the sizes.
        let call = unsafe { alltoall_counts(sendbuf, vec![count; p], recvbuf, vec![count; p], d, OP) }?;
        // SAFETY: the caller keeps the buffers for the request (the header's contract).
        unsafe { call.start(c, req) }
    })
}

/// As `lp_alltoall` with counts per peer.
///
/// # Safety
/// `comm` is null or live; both count arrays have `size` entries; the buffers hold their sums.
#[no_mangle]
pub unsafe extern "C" fn lp_alltoallv(
    comm: *const lp_comm,
    sendbuf: *const c_void,
    sendcounts: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    dtype: c_int,
) -> c_int {
    const OP: &str = "alltoallv";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        // SAFETY: the caller promises `size` entries in each.
        let send = unsafe { counts_from(sendcounts, c.size(), "sendcounts", OP) }?;
        // SAFETY: as above.
        let recv = unsafe { counts_from(recvcounts, c.size(), "recvcounts", OP) }?;
        // SAFETY: the caller promises the sizes.
        unsafe { alltoall_counts(sendbuf, send, recvbuf, recv, d, OP) }?.run(c)
    })
}

/// Returns once every rank has entered.
///
/// # Safety
/// `comm` is null or live.
#[no_mangle]
pub unsafe extern "C" fn lp_barrier(comm: *const lp_comm) -> c_int {
    guarded("barrier", || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, "barrier") }?;
        run(c, &Collective::Barrier, DType::U8, &[], &mut [])
    })
}

/// Nonblocking `lp_barrier`: the request completes once every rank has entered.
///
/// # Safety
/// `comm` is null or live; `req` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_ibarrier(comm: *const lp_comm, req: *mut *mut lp_request) -> c_int {
    const OP: &str = "ibarrier";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let req = unsafe { request_out(req, OP) }?;
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let call = Call { what: Collective::Barrier, dtype: DType::U8, input: &[], output: &mut [] };
        // SAFETY: the call has no buffers.
        unsafe { call.start(c, req) }
    })
}

/// The status of a finished request's call.
fn outcome(request: Request<Lent>) -> Result<(), Failure> {
    request.wait().map(drop).map_err(Failure::from)
}

/// Waits for a request, frees it and returns its call's status.
///
/// # Safety
/// None beyond the header's: any value is accepted (a handle is never dereferenced).
#[no_mangle]
pub unsafe extern "C" fn lp_wait(req: *mut lp_request) -> c_int {
    const OP: &str = "wait";
    guarded(OP, || {
        let request = {
            let mut table = requests();
            let index = table.find(req, OP)?;
            table.take(index)
        };
        outcome(request)
    })
}

/// Whether a request has completed, without blocking; when it has (`*done` = 1), frees it
/// and returns its call's status.
///
/// # Safety
/// `done` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn lp_test(req: *mut lp_request, done: *mut c_int) -> c_int {
    const OP: &str = "test";
    guarded(OP, || {
        if done.is_null() {
            return Err(invalid(OP, "the done pointer is NULL (the request is left pending)"));
        }
        let finished = {
            let mut table = requests();
            match table.find(req, OP) {
                Ok(index) if table.slots[index].request.as_ref().is_some_and(|r| r.is_finished()) => {
                    Some(table.take(index))
                }
                Ok(_) => None,
                Err(e) => {
                    // Nothing to wait for: a `while (!done)` loop ends.
                    // SAFETY: non-null, and the caller promises it is writable.
                    unsafe { done.write(1) };
                    return Err(e);
                }
            }
        };
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { done.write(c_int::from(finished.is_some())) };
        finished.map_or(Ok(()), outcome)
    })
}

/// Sends `count` elements to `peer`.
///
/// # Safety
/// `comm` is null or live; `buf` holds `count` elements (or is null).
#[no_mangle]
pub unsafe extern "C" fn lp_send(
    comm: *const lp_comm,
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
) -> c_int {
    const OP: &str = "send";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        let peer = rank_from(peer, "peer", c, OP)?;
        let len = bytes_of(count, d, OP)?;
        // SAFETY: the caller promises `count` elements.
        let input = unsafe { input(buf, len, "buf", OP) }?;
        run(c, &Collective::Send { count: len, peer }, DType::U8, input, &mut [])
    })
}

/// Receives `count` elements from `peer`.
///
/// # Safety
/// `comm` is null or live; `buf` holds `count` elements (or is null).
#[no_mangle]
pub unsafe extern "C" fn lp_recv(
    comm: *const lp_comm,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
) -> c_int {
    const OP: &str = "recv";
    guarded(OP, || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm, OP) }?;
        let d = dtype_from(dtype, OP)?;
        let peer = rank_from(peer, "peer", c, OP)?;
        let len = bytes_of(count, d, OP)?;
        // SAFETY: the caller promises `count` elements.
        let output = unsafe { output(buf, len, "buf", OP) }?;
        run(c, &Collective::Recv { count: len, peer }, DType::U8, &[], output)
    })
}

/// The last failed call's description on this thread ("" if none).
#[no_mangle]
pub extern "C" fn lp_last_error() -> *const c_char {
    const NONE: &CStr = c"";
    LAST_ERROR
        .try_with(|last| last.borrow().as_ref().map_or(NONE.as_ptr(), |e| e.message.as_ptr()))
        .unwrap_or(NONE.as_ptr())
}

/// The rank the last failed call on this thread names, or -1.
#[no_mangle]
pub extern "C" fn lp_last_error_rank() -> c_int {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ref().and_then(|e| e.rank).and_then(|r| c_int::try_from(r).ok()))
        .ok()
        .flatten()
        .unwrap_or(-1)
}

/// The sequence number of the last failed call on this thread, or -1.
#[no_mangle]
pub extern "C" fn lp_last_error_seq() -> i64 {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ref().and_then(|e| e.seq).and_then(|s| i64::try_from(s).ok()))
        .ok()
        .flatten()
        .unwrap_or(-1)
}

/// A status code's name.
#[no_mangle]
pub extern "C" fn lp_status_name(status: c_int) -> *const c_char {
    let name: &CStr = match status {
        LP_OK => c"LP_OK",
        LP_ERR_INVALID_ARGUMENT => c"LP_ERR_INVALID_ARGUMENT",
        LP_ERR_PEER_FAILED => c"LP_ERR_PEER_FAILED",
        LP_ERR_TIMEOUT => c"LP_ERR_TIMEOUT",
        LP_ERR_ABORTED => c"LP_ERR_ABORTED",
        LP_ERR_MISMATCH => c"LP_ERR_MISMATCH",
        LP_ERR_BOOTSTRAP => c"LP_ERR_BOOTSTRAP",
        LP_ERR_INTERNAL => c"LP_ERR_INTERNAL",
        _ => c"unknown status",
    };
    name.as_ptr()
}
