//! Nonblocking calls for Python: `Communicator.i*` start a call and return a [`Request`].
//!
//! The call runs on the collectives' call thread over the memory of the caller's objects,
//! whose exports ([`View`]s) the request keeps until the call has ended; it is started with
//! [`Communicator::iexecute_then`](lightpath_collectives::Communicator::iexecute_then), so
//! the call thread reports the outcome itself, without taking the GIL. What follows the
//! outcome needs the GIL: releasing the exports and calling the request's `callback` (the
//! torch backend completes its futures there). A thread of Python's waiting in
//! [`Request::wait`] does it itself; otherwise the call thread hands the request to this
//! communicator's completion thread, which takes the GIL for it. Either way it happens once,
//! and `wait` returns only after it did (so a callback's copies are done when `wait`
//! returns).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lightpath_collectives::{CallBuffers, Error, Started};
use pyo3::prelude::*;

use crate::View;

/// The exports of a started call: released only once the call ended, and with the GIL
/// (`Drop` takes it when the thread does not hold it).
pub(crate) struct Exports(Vec<View>);

// SAFETY: a `View` holds raw pointers into a Python object's memory and the export that keeps
// it alive; whoever holds `Exports` never uses them, it only drops the views, and `Drop` below
// does that with the GIL held.
unsafe impl Send for Exports {}

impl Drop for Exports {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            // Nested (cheap) where the GIL is held already: `Call::finish`, a request's drop.
            Python::attach(|_| self.0.clear());
        }
    }
}

/// The bytes of a started call's buffers, for the call thread.
pub(crate) struct RawBuffers {
    input: (*const u8, usize),
    output: (*mut u8, usize),
}

// SAFETY: the pointers are into the memory of exports that the call's `Exports` keeps alive
// until the call has ended (see `Call`), and nothing else in Lightpath touches that memory
// meanwhile (the caller is told not to, as with every nonblocking API).
unsafe impl Send for RawBuffers {}

impl RawBuffers {
    pub(crate) fn new(input: Option<&View>, output: Option<&mut View>) -> RawBuffers {
        let input = input.map_or((std::ptr::null(), 0), |v| {
            let b = v.bytes();
            (b.as_ptr(), b.len())
        });
        let output = output.map_or((std::ptr::null_mut(), 0), |v| {
            let b = v.bytes_mut();
            (b.as_mut_ptr(), b.len())
        });
        RawBuffers { input, output }
    }
}

impl CallBuffers for RawBuffers {
    fn buffers(&mut self) -> (&[u8], &mut [u8]) {
        let input: &[u8] = if self.input.1 == 0 {
            &[]
        } else {
            // SAFETY: see `RawBuffers`: the export behind the pointer lives until the call
            // ended, and this slice is used only by the call.
            unsafe { std::slice::from_raw_parts(self.input.0, self.input.1) }
        };
        let output: &mut [u8] = if self.output.1 == 0 {
            &mut []
        } else {
            // SAFETY: as above; the output was exported writable and checked not to overlap
            // the input, so this is the only reference to it.
            unsafe { std::slice::from_raw_parts_mut(self.output.0, self.output.1) }
        };
        (input, output)
    }
}

/// What follows a call's end, with the GIL: release the exports, then call the callback.
struct Finish {
    exports: Exports,
    callback: Option<Py<PyAny>>,
}

enum Stage {
    /// Not yet done (the call may have ended or not).
    Pending(Finish),
    /// A thread is doing it.
    Running,
    Done,
}

struct CallState {
    /// Set by the call thread when the call ends.
    outcome: Option<Result<(), Error>>,
    /// Threads of Python's sleeping in `Request::wait`: then the call thread wakes them
    /// instead of handing the request to the completion thread.
    waiters: usize,
    stage: Stage,
}

/// One started call, shared by its [`Request`], the call thread and the completion thread.
pub(crate) struct Call {
    state: Mutex<CallState>,
    changed: Condvar,
    /// The call as started, which a waiter runs itself if the call thread has not begun it.
    started: std::sync::OnceLock<Started>,
}

impl Call {
    fn lock(&self) -> MutexGuard<'_, CallState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// On the call thread: records the outcome; wakes the waiters, or, if none, queues the
    /// call for the completion thread. Takes no GIL.
    fn ended(self: &Arc<Self>, outcome: Result<(), Error>, completer: &Sender<Arc<Call>>) {
        let mut st = self.lock();
        st.outcome = Some(outcome);
        if st.waiters > 0 {
            drop(st);
            self.changed.notify_all();
            return;
        }
        drop(st);
        // If the completion thread has gone (the communicator was closed or dropped while
        // this call ran), the request's own `wait` or drop finishes it; if the request has
        // gone too, the exports are released when the last reference goes (`Exports`).
        let _ = completer.send(self.clone());
    }

    /// Releases the exports and calls the callback, once (if another thread is doing it,
    /// returns at once). Needs the call to have ended.
    fn finish(&self, py: Python<'_>) {
        let (finish, outcome) = {
            let mut st = self.lock();
            if st.outcome.is_none() {
                return;
            }
            match std::mem::replace(&mut st.stage, Stage::Running) {
                Stage::Pending(f) => (f, st.outcome.clone().unwrap_or(Ok(()))),
                other => {
                    st.stage = other;
                    return;
                }
            }
        };
        drop(finish.exports);
        if let Some(callback) = finish.callback {
            let arg: Option<Py<PyAny>> = match &outcome {
                Ok(()) => None,
                Err(e) => Some(crate::to_pyerr(py, e).into_value(py).into_any()),
            };
            if let Err(err) = callback.call1(py, (arg,)) {
                err.write_unraisable(py, Some(callback.bind(py)));
            }
        }
        self.lock().stage = Stage::Done;
        self.changed.notify_all();
    }

    /// Waits (without the GIL) until the call ended and was finished, or `timeout` passed;
    /// finishes it here if nobody has. Returns the outcome, `None` on timeout.
    fn wait(&self, py: Python<'_>, timeout: Option<Duration>) -> Option<Result<(), Error>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ended = py.detach(|| {
                self.lock().waiters += 1;
                // A blocking wait right after the start (torch's synchronous calls) runs the
                // call here rather than waking the call thread and sleeping until it is done;
                // not a wait with a timeout, which the call could outlast.
                if let (None, Some(started)) = (deadline, self.started.get()) {
                    started.run_here();
                }
                let mut st = self.lock();
                let ended = loop {
                    let settled = match st.stage {
                        Stage::Done => true,
                        Stage::Pending(_) => st.outcome.is_some(),
                        Stage::Running => false,
                    };
                    if settled {
                        break true;
                    }
                    match deadline {
                        None => st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner()),
                        Some(d) => {
                            let now = Instant::now();
                            if now >= d {
                                break false;
                            }
                            st = self.changed.wait_timeout(st, d - now).unwrap_or_else(|e| e.into_inner()).0;
                        }
                    }
                };
                st.waiters -= 1;
                ended
            });
            if !ended {
                return None;
            }
            self.finish(py);
            let st = self.lock();
            if matches!(st.stage, Stage::Done) {
                return st.outcome.clone();
            }
            // Another thread started finishing between the look and `finish`: wait for it.
        }
    }
}

/// A communicator's completion thread: takes the GIL for the calls that ended while nobody
/// waited for them.
pub(crate) struct Completer {
    send: Sender<Arc<Call>>,
    thread: JoinHandle<()>,
}

impl Completer {
    pub(crate) fn start() -> std::io::Result<Completer> {
        let (send, receive) = std::sync::mpsc::channel::<Arc<Call>>();
        let thread =
            std::thread::Builder::new().name("lightpath-py-done".into()).spawn(move || run(receive))?;
        Ok(Completer { send, thread })
    }

    pub(crate) fn sender(&self) -> Sender<Arc<Call>> {
        self.send.clone()
    }

    /// Stops the thread once it has finished what was queued (call without the GIL: the
    /// thread may need it).
    pub(crate) fn stop(self) {
        drop(self.send);
        let _ = self.thread.join();
    }
}

fn run(receive: Receiver<Arc<Call>>) {
    while let Ok(call) = receive.recv() {
        Python::attach(|py| {
            call.finish(py);
            // Whatever else ended meanwhile, under the same hold of the GIL.
            while let Ok(more) = receive.try_recv() {
                more.finish(py);
            }
        });
    }
}

/// Starts a call: `start` issues it with the function the call thread must call when it
/// ends. The request keeps `exports` until then.
pub(crate) fn launch(
    exports: Vec<View>,
    callback: Option<Py<PyAny>>,
    completer: Sender<Arc<Call>>,
    start: impl FnOnce(Box<dyn FnOnce(Result<(), Error>) + Send>) -> Result<Started, Error>,
) -> Result<Request, Error> {
    let call = Arc::new(Call {
        state: Mutex::new(CallState {
            outcome: None,
            waiters: 0,
            stage: Stage::Pending(Finish { exports: Exports(exports), callback }),
        }),
        changed: Condvar::new(),
        started: std::sync::OnceLock::new(),
    });
    let ended = call.clone();
    let started = start(Box::new(move |outcome| ended.ended(outcome, &completer)))?;
    let _ = call.started.set(started);
    Ok(Request { call })
}

/// A nonblocking call started by one of :class:`Communicator`'s ``i*`` methods.
///
/// The buffers passed to the call belong to it until it has ended: do not read or write
/// them before :meth:`wait` returns (or the callback ran). Dropping a request does not
/// cancel its call; the buffers are still kept alive until the call ends.
#[pyclass(frozen, name = "Request", module = "lightpath._lightpath")]
pub(crate) struct Request {
    call: Arc<Call>,
}

#[pymethods]
impl Request {
    /// Waits for the call (without the GIL) and raises its error, if it failed. With a
    /// ``timeout`` in seconds, returns False if the call has not ended by then, else True.
    /// The request's callback has run when this returns True.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = timeout
            .map(|s| {
                Duration::try_from_secs_f64(s).map_err(|_| {
                    pyo3::exceptions::PyValueError::new_err(format!("timeout={s}: give seconds >= 0"))
                })
            })
            .transpose()?;
        match self.call.wait(py, timeout) {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => Err(crate::to_pyerr(py, &e)),
        }
    }

    /// Whether the call has ended and its callback ran (then :meth:`wait` returns at once).
    fn done(&self) -> bool {
        matches!(self.call.lock().stage, Stage::Done)
    }

    fn __repr__(&self) -> String {
        let st = self.call.lock();
        let what = match (&st.stage, &st.outcome) {
            (Stage::Done, Some(Ok(()))) => "done",
            (Stage::Done, _) => "failed",
            (_, Some(_)) => "ended",
            (_, None) => "running",
        };
        format!("<lightpath.Request {what}>")
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A request dropped (with the GIL, as every Python object) after its call ended but
        // before anybody finished it (the completion thread had gone): finish it now. Before
        // the call ended, the call thread hands it to the completion thread.
        let ended_unfinished = {
            let st = self.call.lock();
            st.outcome.is_some() && matches!(st.stage, Stage::Pending(_))
        };
        if ended_unfinished {
            Python::attach(|py| self.call.finish(py));
        }
    }
}
