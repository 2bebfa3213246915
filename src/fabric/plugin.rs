//! The C ABI plug-in fabric: [`Plugin::load`] opens a transport shared object written against
//! `src/fabric/kvrelay_transport.h` ([`HEADER`]), [`PluginEndpoint`] implements [`Endpoint`] over it with the
//! contract of [`super::verbs`], and [`PluginTransport`] is a [`Transport`] for the certification kit
//! (`--fabric plugin:PATH`).
//!
//! With the RDMA fabric (`rdma.rs`, feature `rdma`) this is one of the crate's two modules with `unsafe` code
//! (ARCHITECTURE.md, "Unsafe code"): every plug-in call is a foreign call on raw pointers, and registered memory is
//! written by the plug-in behind Rust's back. Every `unsafe` block says why it is sound in a `SAFETY:` comment;
//! what no Rust code can check (that the plug-in keeps inside the memory it was handed, that its texts are
//! NUL-terminated) is the plug-in's side of the ABI. How the contract is kept:
//!
//! - **Loading.** The file must exist and be a shared object exporting [`ENTRY_SYMBOL`]; the function table it
//!   returns must carry [`ABI_VERSION`], be at least as large as this loader's, have every required function,
//!   and its `info` text must name the transport and its version. Each refusal is a [`PluginError`] naming the
//!   path and the fix.
//! - **Posting.** [`Endpoint::post_send`] checks everything the contract refuses in software first (unknown or
//!   unconnected QP, SGE count, message size, and the send-queue credits with the same `SendQueue` accounting
//!   as every fabric), so the plug-in never sees a refused batch. The plug-in sees each work request's position
//!   on its QP as `wr_id`; the caller's `wr_id` and message length wait in a ring of slots indexed by position.
//!   That bookkeeping, the ready completions and the `poll_cq` loop are `super::shell`'s, shared with the RDMA
//!   fabric; this module makes the plug-in's calls and checks its answers.
//! - **Completions.** Every completion the plug-in returns is checked: an unknown status or kind, a position that
//!   is not outstanding or comes out of post order, or a successful `byte_len` other than the work request's
//!   length makes the loader speak for the QP from then on: the offending work request (or the first unreported
//!   one) completes [`WcStatus::LocalProtection`], every later one [`WcStatus::Flushed`] (made here, the plug-in
//!   is no longer called for that QP). A completion for a QP the endpoint never created, or a failed `poll`, does
//!   the same to every QP with work outstanding (whichever work request it was is lost). Each such fault is kept in
//!   [`PluginEndpoint::faults`]. A successful completion of an unsignalled work request is not handed out.
//!   Send-queue slots are freed when a completion is handed out by [`Endpoint::poll_cq`], as the contract says.
//! - **Memory.** A registration keeps the `Vec`'s heap buffer in place as raw parts (pointer, length, capacity):
//!   no Rust reference to it lives while the plug-in may write it; reads copy through the raw pointer with bounds
//!   checks, and deregistration rebuilds the `Vec` only after the plug-in revoked the keys. An empty `Vec` is given
//!   a one-byte allocation first, so that every region has an address of its own.
//! - **Waiting.** [`Endpoint::wait`] calls the plug-in's `wait`, or without one polls it every 50 µs until the
//!   timeout: both bounded.
//! - **Teardown.** Dropping an endpoint (or [`Transport::reset`]) closes the plug-in's endpoint first, then frees
//!   the registered memory; the shared object stays loaded while any endpoint of it is alive.
//!
//! Threads: a plug-in is called from one thread, never re-entrantly (the header's assumption); [`Plugin`] and its
//! endpoints are neither `Send` nor `Sync`, so the compiler keeps it so. The dynamic loader shares one instance of
//! a shared object between every load of its path in the process (its global state too): load one plug-in on one
//! thread at a time.
#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![allow(
    clippy::disallowed_methods,
    reason = "the plug-in fabric's bounded waits (a plug-in without wait, Transport::step and settle) are a real-clock edge"
)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use super::shell::{self, Backend, Shell};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, WcKind, WcStatus, WorkCompletion, WorkRequest,
};

/// The ABI version this loader accepts (`KVRELAY_TRANSPORT_ABI_VERSION` of the header).
pub const ABI_VERSION: u32 = 1;
/// The one symbol a plug-in exports: `const kvrelay_transport_ops *kvrelay_transport_v1(void)`.
pub const ENTRY_SYMBOL: &str = "kvrelay_transport_v1";
/// The C header a plug-in is written against (src/fabric/kvrelay_transport.h), for writing it out.
pub const HEADER: &str = include_str!("kvrelay_transport.h");

/// `KVRELAY_ERR_INTERNAL`: the code the loader reports for a plug-in that broke the ABI in an answer.
const ERR_INTERNAL: i32 = 8;
/// Longest plug-in error text kept (longer ones are cut).
const MAX_MESSAGE_CHARS: usize = 1000;
/// Completions fetched from the plug-in per `poll` call.
const FETCH_BATCH: usize = 64;
/// How often a plug-in without `wait` is polled while waiting.
const POLL_INTERVAL: Duration = Duration::from_micros(50);
/// How long [`Transport::step`] lets pass.
const STEP: Duration = Duration::from_millis(1);
/// Default bound of [`Transport::settle`].
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

// ---- The C ABI, mirrored field for field (kvrelay_transport.h) ----

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawCaps {
    max_sge: u32,
    sq_depth: u32,
    max_message: u64,
    max_registered_bytes: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawRegion {
    addr: u64,
    len: u64,
    lkey: u32,
    rkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawQpInfo {
    node: u32,
    qpn: u32,
    lid: u16,
    gid: [u8; 16],
    reserved: [u8; 2],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawSge {
    addr: u64,
    len: u64,
    lkey: u32,
    reserved: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawWorkRequest {
    wr_id: u64,
    sges: *const RawSge,
    num_sge: u32,
    flags: u32,
    remote_addr: u64,
    rkey: u32,
    imm: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawCompletion {
    wr_id: u64,
    byte_len: u64,
    qpn: u32,
    status: u32,
    kind: u32,
    imm: u32,
}

/// `kvrelay_endpoint`: opaque.
#[repr(C)]
struct RawEndpoint {
    _opaque: [u8; 0],
}

const WR_SIGNALED: u32 = 1;
const WR_WITH_IMM: u32 = 2;

// SAFETY: a pointer type only (`InfoFn`); each call through one says why it is sound.
type InfoFn = unsafe extern "C" fn() -> *const c_char;
// SAFETY: a pointer type only (`CapabilitiesFn`); each call through one says why it is sound.
type CapabilitiesFn = unsafe extern "C" fn(*mut RawCaps) -> c_int;
// SAFETY: a pointer type only (`OpenFn`); each call through one says why it is sound.
type OpenFn = unsafe extern "C" fn(u32, *const RawCaps, *mut RawCaps, *mut *mut RawEndpoint) -> c_int;
// SAFETY: a pointer type only (`CloseFn`); each call through one says why it is sound.
type CloseFn = unsafe extern "C" fn(*mut RawEndpoint);
// SAFETY: a pointer type only (`RegisterFn`); each call through one says why it is sound.
type RegisterFn = unsafe extern "C" fn(*mut RawEndpoint, *mut c_void, u64, *mut RawRegion) -> c_int;
// SAFETY: a pointer type only (`DeregisterFn`); each call through one says why it is sound.
type DeregisterFn = unsafe extern "C" fn(*mut RawEndpoint, *const RawRegion) -> c_int;
// SAFETY: a pointer type only (`CreateQpFn`); each call through one says why it is sound.
type CreateQpFn = unsafe extern "C" fn(*mut RawEndpoint, *mut RawQpInfo) -> c_int;
// SAFETY: a pointer type only (`ConnectQpFn`); each call through one says why it is sound.
type ConnectQpFn = unsafe extern "C" fn(*mut RawEndpoint, u32, *const RawQpInfo) -> c_int;
// SAFETY: a pointer type only (`PostFn`); each call through one says why it is sound.
type PostFn = unsafe extern "C" fn(*mut RawEndpoint, u32, *const RawWorkRequest, usize) -> c_int;
// SAFETY: a pointer type only (`PollFn`); each call through one says why it is sound.
type PollFn = unsafe extern "C" fn(*mut RawEndpoint, *mut RawCompletion, usize, *mut usize) -> c_int;
// SAFETY: a pointer type only (`WaitFn`); each call through one says why it is sound.
type WaitFn = unsafe extern "C" fn(*mut RawEndpoint, u64) -> c_int;
// SAFETY: a pointer type only (`LastErrorFn`); each call through one says why it is sound.
type LastErrorFn = unsafe extern "C" fn(*const RawEndpoint) -> *const c_char;
// SAFETY: a pointer type only (`EntryFn`); each call through one says why it is sound.
type EntryFn = unsafe extern "C" fn() -> *const RawTable;

/// `kvrelay_transport_ops` as it is in memory: every function pointer nullable.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawTable {
    abi_version: u32,
    struct_size: u32,
    info: Option<InfoFn>,
    capabilities: Option<CapabilitiesFn>,
    open: Option<OpenFn>,
    close: Option<CloseFn>,
    register_memory: Option<RegisterFn>,
    deregister_memory: Option<DeregisterFn>,
    create_qp: Option<CreateQpFn>,
    connect_qp: Option<ConnectQpFn>,
    post: Option<PostFn>,
    poll: Option<PollFn>,
    wait: Option<WaitFn>,
    last_error: Option<LastErrorFn>,
}

/// The function table once checked: every required function present.
#[derive(Clone, Copy)]
struct Ops {
    capabilities: CapabilitiesFn,
    open: OpenFn,
    close: CloseFn,
    register_memory: RegisterFn,
    deregister_memory: DeregisterFn,
    create_qp: CreateQpFn,
    connect_qp: ConnectQpFn,
    post: PostFn,
    poll: PollFn,
    wait: Option<WaitFn>,
    last_error: Option<LastErrorFn>,
}

/// Why a plug-in could not be loaded; each names the path and the fix.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("no plug-in at {path}: no such file (fix: build it, e.g. `bash ci/plugin.sh` for the sample, and pass its path)")]
    NotFound { path: PathBuf },
    #[error(
        "{path} is not a loadable shared object ({reason}) (fix: build it with `cc -shared -fPIC` for this machine)"
    )]
    NotSharedObject { path: PathBuf, reason: String },
    #[error("{path} does not export `{ENTRY_SYMBOL}` ({reason}) (fix: define `const kvrelay_transport_ops *{ENTRY_SYMBOL}(void)` from src/fabric/kvrelay_transport.h, with default visibility)")]
    MissingSymbol { path: PathBuf, reason: String },
    #[error("{path}: `{ENTRY_SYMBOL}` returned NULL (fix: return the address of a static kvrelay_transport_ops)")]
    NullTable { path: PathBuf },
    #[error("{path} was built for plug-in ABI version {found}, this kvrelay loads version {expected} (fix: rebuild it against src/fabric/kvrelay_transport.h of this kvrelay)")]
    AbiMismatch { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: its kvrelay_transport_ops is {found} bytes, this kvrelay needs {expected} (fix: set struct_size to sizeof(kvrelay_transport_ops) and rebuild against this kvrelay's header)")]
    TableTooSmall { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: the function `{function}` of its kvrelay_transport_ops is NULL (fix: implement it; only `wait` and `last_error` may be NULL)")]
    NullFunction { path: PathBuf, function: &'static str },
    #[error("{path}: its `info` text is unusable: {reason} (fix: return static `name=...\\nversion=...\\n` lines)")]
    BadInfo { path: PathBuf, reason: String },
    #[error("{path}: `capabilities` {reason} (fix: return KVRELAY_OK with max_sge and sq_depth of at least 1)")]
    BadCapabilities { path: PathBuf, reason: String },
}

/// What a plug-in says about itself (its `info` text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// The `name=` line.
    pub name: String,
    /// The `version=` line.
    pub version: String,
    /// Every other `key=value` line, by key.
    pub facts: BTreeMap<String, String>,
}

/// A plug-in's limits (`kvrelay_caps`): the verbs [`Caps`] plus how many bytes one endpoint may register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginCaps {
    pub max_sge: usize,
    pub max_message: u64,
    pub sq_depth: usize,
    pub max_registered_bytes: u64,
}

impl PluginCaps {
    /// The verbs limits.
    pub fn caps(&self) -> Caps {
        Caps { max_sge: self.max_sge, max_message: self.max_message, sq_depth: self.sq_depth }
    }

    fn raw(&self) -> RawCaps {
        RawCaps {
            max_sge: u32::try_from(self.max_sge).unwrap_or(u32::MAX),
            sq_depth: u32::try_from(self.sq_depth).unwrap_or(u32::MAX),
            max_message: self.max_message,
            max_registered_bytes: self.max_registered_bytes,
        }
    }

    fn from_raw(raw: RawCaps) -> PluginCaps {
        PluginCaps {
            max_sge: raw.max_sge as usize,
            max_message: raw.max_message,
            sq_depth: raw.sq_depth as usize,
            max_registered_bytes: raw.max_registered_bytes,
        }
    }

    /// Each limit the smaller of the two.
    fn min(&self, other: &PluginCaps) -> PluginCaps {
        PluginCaps {
            max_sge: self.max_sge.min(other.max_sge),
            max_message: self.max_message.min(other.max_message),
            sq_depth: self.sq_depth.min(other.sq_depth),
            max_registered_bytes: self.max_registered_bytes.min(other.max_registered_bytes),
        }
    }
}

/// The loaded shared object, its checked table and what it said at load time. Fields drop in order: the library
/// last, after nothing can call into it.
struct Loaded {
    path: PathBuf,
    ops: Ops,
    info: PluginInfo,
    caps: PluginCaps,
    _library: libloading::Library,
}

/// A loaded transport plug-in; cloning gives another handle onto the same shared object.
#[derive(Clone)]
pub struct Plugin {
    loaded: Rc<Loaded>,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.loaded.path)
            .field("info", &self.loaded.info)
            .field("caps", &self.loaded.caps)
            .finish()
    }
}

impl Plugin {
    /// Loads the plug-in at `path` and checks its ABI (see the module docs); its `info` and `capabilities` are
    /// read once, here.
    pub fn load(path: impl AsRef<Path>) -> Result<Plugin, PluginError> {
        let given = path.as_ref();
        if !given.is_file() {
            return Err(PluginError::NotFound { path: given.to_path_buf() });
        }
        // An absolute path, so that the dynamic loader never searches its library path for a bare name.
        let path = given.canonicalize().map_err(|_| PluginError::NotFound { path: given.to_path_buf() })?;
        // SAFETY: loading a shared object runs its initializers; the object is the plug-in the user named to be
        // run in this process, which is the trust the plug-in ABI is built on (kvrelay_transport.h).
        let library = unsafe { libloading::Library::new(&path) }
            .map_err(|error| PluginError::NotSharedObject { path: path.clone(), reason: error.to_string() })?;
        // SAFETY: the symbol's type is the entry point's signature in kvrelay_transport.h; the function pointer is
        // copied out and only called while `library` is alive (it moves into `Loaded` with it).
        let entry: EntryFn = unsafe { library.get::<EntryFn>(ENTRY_SYMBOL.as_bytes()) }
            .map(|symbol| *symbol)
            .map_err(|error| PluginError::MissingSymbol { path: path.clone(), reason: error.to_string() })?;
        // SAFETY: the entry point takes no arguments and returns a pointer (ABI of the header).
        let table = unsafe { entry() };
        if table.is_null() {
            return Err(PluginError::NullTable { path });
        }
        // SAFETY: every version of the table starts with the two u32 fields abi_version and struct_size, so they
        // can be read before the rest of the layout is known; the pointer is non-null and points at the plug-in's
        // static table (the header's promise), suitably aligned for its u64/pointer fields.
        let (found, size) = unsafe { ((*table.cast::<u32>()), *table.cast::<u32>().add(1)) };
        if found != ABI_VERSION {
            return Err(PluginError::AbiMismatch { path, found, expected: ABI_VERSION });
        }
        let expected = std::mem::size_of::<RawTable>() as u32;
        if size < expected {
            return Err(PluginError::TableTooSmall { path, found: size, expected });
        }
        // SAFETY: the table is at least `size_of::<RawTable>()` bytes (struct_size says so) of the version-1
        // layout, which RawTable mirrors with nullable function pointers; it is copied out.
        let raw = unsafe { table.read() };
        let ops = check_table(&raw, &path)?;
        let info = read_info(raw.info, &path)?;
        let mut caps = RawCaps::default();
        // SAFETY: `capabilities` is the plug-in's function of this signature; `caps` is a valid, writable struct.
        let code = unsafe { (ops.capabilities)(&mut caps) };
        if code != 0 {
            let reason = format!("returned error code {code}");
            return Err(PluginError::BadCapabilities { path, reason });
        }
        if caps.max_sge == 0 || caps.sq_depth == 0 {
            let reason = format!("grants max_sge {} and sq_depth {}", caps.max_sge, caps.sq_depth);
            return Err(PluginError::BadCapabilities { path, reason });
        }
        let caps = PluginCaps::from_raw(caps);
        Ok(Plugin { loaded: Rc::new(Loaded { path, ops, info, caps, _library: library }) })
    }

    /// The shared object's path (absolute).
    pub fn path(&self) -> &Path {
        &self.loaded.path
    }

    /// What the plug-in said about itself.
    pub fn info(&self) -> &PluginInfo {
        &self.loaded.info
    }

    /// The plug-in's limits, whatever an endpoint asks for.
    pub fn capabilities(&self) -> PluginCaps {
        self.loaded.caps
    }

    /// Who the transport is, for a certification report: `plugin:<name>`, its version, its facts plus `path`
    /// and `abi_version`.
    pub fn identity(&self) -> Identity {
        let info = &self.loaded.info;
        let mut facts = info.facts.clone();
        facts.insert("path".to_owned(), self.loaded.path.display().to_string());
        facts.insert("abi_version".to_owned(), ABI_VERSION.to_string());
        Identity { name: format!("plugin:{}", info.name), version: info.version.clone(), facts }
    }

    /// Opens an endpoint for `node` asking for `caps` (the plug-in may grant less: see [`Endpoint::caps`]).
    pub fn open(&self, node: NodeId, caps: Caps) -> Result<PluginEndpoint, FabricError> {
        let loaded = &self.loaded;
        let asked = PluginCaps {
            max_sge: caps.max_sge,
            max_message: caps.max_message,
            sq_depth: caps.sq_depth,
            max_registered_bytes: loaded.caps.max_registered_bytes,
        }
        .min(&loaded.caps);
        let requested = asked.raw();
        let mut granted = RawCaps::default();
        let mut handle: *mut RawEndpoint = std::ptr::null_mut();
        // SAFETY: `open` is the plug-in's function of this signature; the three pointers are valid for the call.
        let code = unsafe { (loaded.ops.open)(node.0, &requested, &mut granted, &mut handle) };
        if code != 0 {
            return Err(plugin_error(&loaded.ops, None, "open", code));
        }
        let Some(raw) = NonNull::new(handle) else {
            return Err(broken("open", "returned KVRELAY_OK without an endpoint".to_owned()));
        };
        let granted = PluginCaps::from_raw(granted).min(&asked);
        if granted.max_sge == 0 || granted.sq_depth == 0 {
            // SAFETY: `raw` is the endpoint `open` just returned, closed once and never used again.
            unsafe { (loaded.ops.close)(raw.as_ptr()) };
            let message = format!("granted max_sge {} and sq_depth {}", granted.max_sge, granted.sq_depth);
            return Err(broken("open", message));
        }
        let state = EndpointState {
            loaded: Rc::clone(loaded),
            raw: Some(raw),
            node,
            caps: granted.caps(),
            max_registered_bytes: granted.max_registered_bytes,
            registered_bytes: 0,
            regions: BTreeMap::new(),
            shell: Shell::default(),
            faults: Vec::new(),
            sges: Vec::new(),
            wrs: Vec::new(),
            fetched: Vec::new(),
        };
        Ok(PluginEndpoint { state: Rc::new(RefCell::new(state)) })
    }
}

/// Every required function present, else the first missing one's name.
fn check_table(raw: &RawTable, path: &Path) -> Result<Ops, PluginError> {
    let null = |function: &'static str| PluginError::NullFunction { path: path.to_path_buf(), function };
    raw.info.ok_or_else(|| null("info"))?;
    Ok(Ops {
        capabilities: raw.capabilities.ok_or_else(|| null("capabilities"))?,
        open: raw.open.ok_or_else(|| null("open"))?,
        close: raw.close.ok_or_else(|| null("close"))?,
        register_memory: raw.register_memory.ok_or_else(|| null("register_memory"))?,
        deregister_memory: raw.deregister_memory.ok_or_else(|| null("deregister_memory"))?,
        create_qp: raw.create_qp.ok_or_else(|| null("create_qp"))?,
        connect_qp: raw.connect_qp.ok_or_else(|| null("connect_qp"))?,
        post: raw.post.ok_or_else(|| null("post"))?,
        poll: raw.poll.ok_or_else(|| null("poll"))?,
        wait: raw.wait,
        last_error: raw.last_error,
    })
}

/// Calls `info` and parses its `key=value` lines.
fn read_info(info: Option<InfoFn>, path: &Path) -> Result<PluginInfo, PluginError> {
    let bad = |reason: &str| PluginError::BadInfo { path: path.to_path_buf(), reason: reason.to_owned() };
    let info = info.ok_or_else(|| bad("NULL function"))?;
    // SAFETY: `info` is the plug-in's function of this signature (no arguments).
    let text = unsafe { info() };
    if text.is_null() {
        return Err(bad("it returned NULL"));
    }
    // SAFETY: non-null, and the header requires a static NUL-terminated text.
    let text = unsafe { CStr::from_ptr(text) };
    let text = text.to_str().map_err(|_| bad("it is not UTF-8"))?;
    PluginInfo::parse(text).map_err(|error| bad(&error.reason))
}

/// Why a plug-in's info text is malformed (kind `info`): the line and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the plug-in's info text is malformed: {reason}")]
pub struct InfoError {
    pub reason: String,
}

impl InfoError {
    /// Always `info`: the one kind of this boundary.
    pub fn kind(&self) -> &'static str {
        "info"
    }
}

impl PluginInfo {
    /// Parses a plug-in's info text (untrusted: fuzz target `plugin_info`): `key=value` lines, `name` and `version`
    /// required and non-empty; the reason it is malformed otherwise.
    pub fn parse(text: &str) -> Result<PluginInfo, InfoError> {
        parse_info(text).map_err(|reason| InfoError { reason })
    }
}

fn parse_info(text: &str) -> Result<PluginInfo, String> {
    let mut facts = BTreeMap::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (key, value) =
            line.split_once('=').ok_or_else(|| format!("line {} `{line}` is not key=value", number + 1))?;
        facts.insert(key.trim().to_owned(), value.trim().to_owned());
    }
    let mut take = |key: &str| facts.remove(key).filter(|value| !value.is_empty());
    let name = take("name").ok_or("it has no `name=` line")?;
    let version = take("version").ok_or("it has no `version=` line")?;
    Ok(PluginInfo { name, version, facts })
}

/// A plug-in answer that breaks the ABI, as an error.
fn broken(call: &'static str, message: String) -> FabricError {
    FabricError::Plugin { call, code: ERR_INTERNAL, message: format!("the plug-in broke its ABI: {message}") }
}

/// The error of a failed plug-in call: its code and, if it has `last_error`, its message.
fn plugin_error(ops: &Ops, raw: Option<NonNull<RawEndpoint>>, call: &'static str, code: c_int) -> FabricError {
    let handle = raw.map_or(std::ptr::null(), |raw| raw.as_ptr().cast_const());
    let text = ops.last_error.and_then(|last_error| {
        // SAFETY: `last_error` is the plug-in's function of this signature; `handle` is a live endpoint or NULL
        // (allowed for open failures by the header).
        let text = unsafe { last_error(handle) };
        if text.is_null() {
            return None;
        }
        // SAFETY: non-null, and the header promises a NUL-terminated text valid until the next plug-in call; it is
        // copied before any.
        let text = unsafe { CStr::from_ptr(text) };
        Some(text.to_string_lossy().chars().take(MAX_MESSAGE_CHARS).collect::<String>())
    });
    let name = match code {
        1 => "KVRELAY_ERR_INVALID",
        2 => "KVRELAY_ERR_UNKNOWN_QP",
        3 => "KVRELAY_ERR_NOT_CONNECTED",
        4 => "KVRELAY_ERR_ALREADY_CONNECTED",
        5 => "KVRELAY_ERR_UNKNOWN_REGION",
        6 => "KVRELAY_ERR_EXHAUSTED",
        7 => "KVRELAY_ERR_UNSUPPORTED",
        _ => "KVRELAY_ERR_INTERNAL",
    };
    let message = match text {
        Some(text) => format!("{name}: {text}"),
        None => name.to_owned(),
    };
    FabricError::Plugin { call, code, message }
}

/// One node's [`Endpoint`] on a plug-in. Dropping it closes the plug-in's endpoint and frees its memory.
pub struct PluginEndpoint {
    state: Rc<RefCell<EndpointState>>,
}

impl fmt::Debug for PluginEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.borrow();
        f.debug_struct("PluginEndpoint")
            .field("plugin", &state.loaded.path)
            .field("node", &state.node)
            .field("caps", &state.caps)
            .field("open", &state.raw.is_some())
            .finish()
    }
}

impl PluginEndpoint {
    /// What the plug-in got wrong so far on this endpoint (each a sentence), oldest first.
    pub fn faults(&self) -> Vec<String> {
        self.state.borrow().faults.clone()
    }

    /// How many bytes this endpoint may register at once.
    pub fn max_registered_bytes(&self) -> u64 {
        self.state.borrow().max_registered_bytes
    }

    /// Whether the plug-in's endpoint was closed ([`Transport::reset`]): every call but `read_local`,
    /// `deregister` and `poll_cq` then fails.
    pub fn is_closed(&self) -> bool {
        self.state.borrow().raw.is_none()
    }
}

/// A registered `Vec`, kept as raw parts while the plug-in may write it.
struct Registered {
    region: MemoryRegion,
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

struct EndpointState {
    loaded: Rc<Loaded>,
    /// `None` once closed.
    raw: Option<NonNull<RawEndpoint>>,
    node: NodeId,
    caps: Caps,
    max_registered_bytes: u64,
    registered_bytes: u64,
    /// By address.
    regions: BTreeMap<u64, Registered>,
    /// The QPs' send queues and the completions not handed out yet; a QP that failed there is one the plug-in
    /// broke the contract on, whose work requests the loader completes itself from then on.
    shell: Shell,
    faults: Vec<String>,
    /// Reused buffers of one post and one fetch.
    sges: Vec<RawSge>,
    wrs: Vec<RawWorkRequest>,
    fetched: Vec<RawCompletion>,
}

impl EndpointState {
    fn handle(&self, call: &'static str) -> Result<NonNull<RawEndpoint>, FabricError> {
        self.raw.ok_or_else(|| FabricError::Plugin {
            call,
            code: ERR_INTERNAL,
            message: "the endpoint was closed (Transport::reset): open a new one".to_owned(),
        })
    }

    fn error(&self, call: &'static str, code: c_int) -> FabricError {
        plugin_error(&self.loaded.ops, self.raw, call, code)
    }

    fn fault(&mut self, call: &'static str, message: String) -> FabricError {
        self.faults.push(format!("{call}: {message}"));
        broken(call, message)
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        let raw = self.handle("register_memory")?;
        let len = bytes.len() as u64;
        if self.registered_bytes.checked_add(len).is_none_or(|total| total > self.max_registered_bytes) {
            return Err(FabricError::Exhausted("registered memory (the plug-in's max_registered_bytes)"));
        }
        // An empty Vec has no buffer: give it one byte of capacity so that its region has an address of its own.
        let bytes = if bytes.capacity() == 0 { Vec::with_capacity(1) } else { bytes };
        let mut bytes = ManuallyDrop::new(bytes);
        let (ptr, capacity) = (bytes.as_mut_ptr(), bytes.capacity());
        let mut out = RawRegion::default();
        // SAFETY: `ptr` is the Vec's live heap buffer of `len` initialised bytes (capacity >= 1, so not dangling);
        // from here on it is only reached through this raw pointer until deregistration rebuilds the Vec.
        let code = unsafe { (self.loaded.ops.register_memory)(raw.as_ptr(), ptr.cast(), len, &mut out) };
        if code != 0 {
            drop(ManuallyDrop::into_inner(bytes));
            return Err(self.error("register_memory", code));
        }
        let region = MemoryRegion { addr: out.addr, len: out.len, lkey: out.lkey, rkey: out.rkey };
        if out.addr != ptr as u64 || out.len != len || self.regions.contains_key(&out.addr) {
            // SAFETY: the region the plug-in just returned, on its live endpoint; its memory is still ours.
            unsafe { (self.loaded.ops.deregister_memory)(raw.as_ptr(), &out) };
            drop(ManuallyDrop::into_inner(bytes));
            let message = format!("register_memory returned {region:?} for {len} bytes at {ptr:p} (not in place)");
            return Err(self.fault("register_memory", message));
        }
        let ptr = NonNull::new(ptr).expect("a Vec's buffer pointer is never null");
        self.regions.insert(out.addr, Registered { region, ptr, len: len as usize, capacity });
        self.registered_bytes += len;
        Ok(region)
    }

    fn owned(&self, region: &MemoryRegion) -> Result<&Registered, FabricError> {
        self.regions
            .get(&region.addr)
            .filter(|it| it.region == *region)
            .ok_or(FabricError::UnknownRegion { addr: region.addr })
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.owned(region)?;
        if let Some(raw) = self.raw {
            let out = RawRegion { addr: region.addr, len: region.len, lkey: region.lkey, rkey: region.rkey };
            // SAFETY: a live endpoint and a region it registered (checked just above); `out` is valid for the call.
            let code = unsafe { (self.loaded.ops.deregister_memory)(raw.as_ptr(), &out) };
            if code != 0 {
                return Err(self.error("deregister_memory", code));
            }
        }
        let removed = self.regions.remove(&region.addr).expect("checked by owned");
        self.registered_bytes -= removed.len as u64;
        Ok(removed.into_vec())
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        let owned = self.owned(region)?;
        let len = out.len() as u64;
        let fits = offset.checked_add(len).is_some_and(|end| end <= owned.len as u64);
        if !fits {
            return Err(FabricError::OutOfRegion { offset, len, region_len: region.len });
        }
        // SAFETY: `offset + out.len()` is within the registered buffer of `owned.len` initialised bytes, which is
        // alive while registered; `out` is a distinct Rust buffer; the plug-in writes only during calls into it
        // (single thread, the header), and none is running.
        unsafe { std::ptr::copy_nonoverlapping(owned.ptr.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        let raw = self.handle("create_qp")?;
        let mut out = RawQpInfo::default();
        // SAFETY: a live endpoint and a valid, writable struct.
        let code = unsafe { (self.loaded.ops.create_qp)(raw.as_ptr(), &mut out) };
        if code != 0 {
            return Err(self.error("create_qp", code));
        }
        let qpn = QpNum(out.qpn);
        if self.shell.qp(qpn).is_some() || out.node != self.node.0 {
            let message = format!("create_qp returned {qpn} of node {} (in use, or not this {})", out.node, self.node);
            return Err(self.fault("create_qp", message));
        }
        self.shell.add_qp(qpn, self.caps.sq_depth);
        Ok(QpInfo { node: self.node, qpn, lid: out.lid, gid: out.gid })
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        self.shell.check_connect(local)?;
        let raw = self.handle("connect_qp")?;
        let info =
            RawQpInfo { node: remote.node.0, qpn: remote.qpn.0, lid: remote.lid, gid: remote.gid, reserved: [0; 2] };
        // SAFETY: a live endpoint, one of its QPs, and a valid struct for the call.
        let code = unsafe { (self.loaded.ops.connect_qp)(raw.as_ptr(), local.0, &info) };
        if code != 0 {
            return Err(self.error("connect_qp", code));
        }
        self.shell.connect(local);
        Ok(())
    }

    fn post_send(&mut self, qpn: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        self.shell.check_post(qpn, self.caps, wrs)?;
        if wrs.is_empty() {
            return Ok(());
        }
        let raw = self.handle("post")?;
        let book = self.shell.qp(qpn).expect("checked by check_post");
        if !book.failed() {
            self.build(wrs, book.queue().posted());
            // SAFETY: a live endpoint and one of its connected QPs; `self.wrs` holds `wrs.len()` work requests whose
            // SGE pointers point into `self.sges`, neither modified until the call returns; every SGE and remote
            // address is the caller's, checked by the plug-in against its registrations (the header).
            let code = unsafe { (self.loaded.ops.post)(raw.as_ptr(), qpn.0, self.wrs.as_ptr(), self.wrs.len()) };
            self.wrs.clear();
            if code != 0 {
                return Err(self.error("post", code));
            }
        }
        // On a QP the loader took over, completed here: in error if none was yet, else flushed.
        self.shell.record(qpn, wrs);
        Ok(())
    }

    /// Fills the reused raw buffers for `wrs`, whose first has position `first`.
    fn build(&mut self, wrs: &[WorkRequest], first: u64) {
        self.sges.clear();
        self.wrs.clear();
        for wr in wrs {
            self.sges.extend(wr.sges.iter().map(|sge| RawSge {
                addr: sge.addr,
                len: sge.len,
                lkey: sge.lkey,
                reserved: 0,
            }));
        }
        let mut start = 0;
        for (index, wr) in wrs.iter().enumerate() {
            let flags = if wr.signaled { WR_SIGNALED } else { 0 } | if wr.imm.is_some() { WR_WITH_IMM } else { 0 };
            self.wrs.push(RawWorkRequest {
                wr_id: first + index as u64,
                sges: self.sges[start..].as_ptr(),
                num_sge: wr.sges.len() as u32,
                flags,
                remote_addr: wr.remote.addr,
                rkey: wr.remote.rkey,
                imm: wr.imm.unwrap_or(0),
            });
            start += wr.sges.len();
        }
    }

    /// The plug-in broke the contract on `qpn` at `position` (or, if `None`, at its first unreported position):
    /// the loader completes everything outstanding from there in error and speaks for the QP from now on.
    fn take_over(&mut self, qpn: QpNum, position: Option<u64>, message: String) {
        self.faults
            .push(format!("poll: {qpn}: {message}; the loader completes its work requests in error from now on"));
        self.shell.take_over(qpn, position);
    }

    /// The plug-in's CQ is corrupt: whichever work request a bad completion was is lost, so every QP with work
    /// still outstanding completes it in error rather than waiting for it forever.
    fn take_over_all(&mut self, message: String) {
        let waiting: Vec<QpNum> = self
            .shell
            .qps()
            .filter(|(_, qp)| !qp.failed() && qp.completed_end() < qp.queue().posted())
            .map(|(qpn, _)| qpn)
            .collect();
        if waiting.is_empty() {
            self.faults.push(format!("poll: {message}; no QP awaits a completion, so it was dropped"));
        }
        for waiting in waiting {
            self.take_over(waiting, None, message.clone());
        }
    }

    /// Takes up to about `want` completions off the plug-in's CQ into the shell, checking each.
    fn fetch(&mut self, want: usize) {
        let mut fetched = 0;
        while fetched < want {
            let batch = FETCH_BATCH.min(want - fetched);
            if !self.fetch_batch(batch) {
                return;
            }
            fetched += batch;
        }
    }

    /// Takes up to `batch` completions off the plug-in's CQ into the shell, checking each; whether it gave all
    /// `batch` (a closed endpoint or a failed `poll` gives none).
    fn fetch_batch(&mut self, batch: usize) -> bool {
        let Some(raw) = self.raw else { return false };
        self.fetched.clear();
        self.fetched.resize(batch, RawCompletion::default());
        let mut polled = 0usize;
        // SAFETY: a live endpoint; `self.fetched` holds `batch` initialised, writable completions and `polled` is
        // writable, both for the call only.
        let code = unsafe { (self.loaded.ops.poll)(raw.as_ptr(), self.fetched.as_mut_ptr(), batch, &mut polled) };
        if code != 0 {
            let error = self.error("poll", code);
            self.take_over_all(format!("poll failed: {error}"));
            return false;
        }
        if polled > batch {
            self.faults.push(format!("poll: the plug-in returned {polled} completions into room for {batch}"));
        }
        let taken = polled.min(batch);
        for index in 0..taken {
            let raw = self.fetched[index];
            self.accept(raw);
        }
        taken == batch
    }

    /// Checks one completion from the plug-in and queues what it means.
    fn accept(&mut self, raw: RawCompletion) {
        let qpn = QpNum(raw.qpn);
        let Some(qp) = self.shell.qp(qpn) else {
            return self.take_over_all(format!("a completion for {qpn}, which this endpoint never created"));
        };
        if qp.failed() {
            return; // taken over: the loader speaks for the QP
        }
        let status = match raw.status {
            0 => Some(WcStatus::Success),
            1 => Some(WcStatus::LocalProtection),
            2 => Some(WcStatus::RemoteAccess),
            3 => Some(WcStatus::RetryExceeded),
            4 => Some(WcStatus::Flushed),
            _ => None,
        };
        match raw.kind {
            1 => self.accept_notification(qpn, status, raw),
            0 => {
                let position = raw.wr_id;
                if position < qp.completed_end() || position >= qp.queue().posted() {
                    let message = format!("a completion for position {position}, which is not outstanding");
                    return self.take_over(qpn, None, message);
                }
                let Some(slot) = qp.slot(position) else {
                    return self.take_over(qpn, None, format!("a completion for position {position}, already freed"));
                };
                let Some(status) = status else {
                    return self.take_over(qpn, Some(position), format!("unknown status code {}", raw.status));
                };
                if status == WcStatus::Success && raw.byte_len != slot.byte_len {
                    let message = format!("byte_len {} for a work request of {} bytes", raw.byte_len, slot.byte_len);
                    return self.take_over(qpn, Some(position), message);
                }
                // A success of an unsignalled work request gives no completion (the contract).
                self.shell.complete(qpn, position, status);
            }
            kind => self.take_over(qpn, None, format!("unknown completion kind {kind}")),
        }
    }

    /// A receiver's WRITE_WITH_IMM notification: handed out when it reports success (a failed write is reported
    /// by its sender's completion).
    fn accept_notification(&mut self, qpn: QpNum, status: Option<WcStatus>, raw: RawCompletion) {
        match status {
            Some(WcStatus::Success) if raw.byte_len <= self.caps.max_message => {
                let wc = WorkCompletion {
                    wr_id: 0,
                    qp: qpn,
                    status: WcStatus::Success,
                    kind: WcKind::RecvImm,
                    imm: Some(raw.imm),
                    byte_len: raw.byte_len,
                };
                self.shell.push_notification(wc);
            }
            Some(WcStatus::Success) => self.faults.push(format!(
                "poll: a notification on {qpn} of {} bytes, over max_message, was dropped",
                raw.byte_len
            )),
            Some(_) => {}
            None => self.faults.push(format!("poll: a notification on {qpn} with unknown status {}", raw.status)),
        }
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        shell::poll_cq(self, out, max)
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        if self.shell.ready() > 0 {
            return true;
        }
        let Some(raw) = self.raw else { return false };
        if let Some(wait) = self.loaded.ops.wait {
            let micros = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX);
            // SAFETY: a live endpoint; the plug-in's optional function of this signature.
            return unsafe { wait(raw.as_ptr(), micros) } != 0;
        }
        let deadline = Deadline::after(timeout);
        loop {
            self.fetch(FETCH_BATCH);
            if self.shell.ready() > 0 {
                return true;
            }
            match deadline.left() {
                Some(left) => std::thread::sleep(POLL_INTERVAL.min(left)),
                None => return false,
            }
        }
    }

    /// Whether every signalled work request posted so far has been completed by the plug-in.
    fn settled(&self) -> bool {
        !self.shell.awaits_completions()
    }

    /// Closes the plug-in's endpoint (its registrations with it); the memory stays owned here.
    fn close(&mut self) {
        if let Some(raw) = self.raw.take() {
            // SAFETY: a live endpoint, closed once (`raw` is taken) and never used again.
            unsafe { (self.loaded.ops.close)(raw.as_ptr()) };
        }
    }
}

impl Backend for EndpointState {
    fn shell(&mut self) -> &mut Shell {
        &mut self.shell
    }

    fn fetch(&mut self, want: usize) -> bool {
        self.fetch_batch(FETCH_BATCH.min(want))
    }
}

impl Registered {
    /// The `Vec` this registration came from (call only once the plug-in no longer holds it).
    fn into_vec(self) -> Vec<u8> {
        // SAFETY: pointer, length and capacity are those of a Vec<u8> given up with ManuallyDrop in `register`,
        // rebuilt exactly once (the registration is consumed) after the plug-in revoked its keys (deregister or
        // close).
        unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.capacity) }
    }
}

impl Drop for EndpointState {
    fn drop(&mut self) {
        self.close();
        for (_, registered) in std::mem::take(&mut self.regions) {
            drop(registered.into_vec());
        }
    }
}

impl Endpoint for PluginEndpoint {
    fn caps(&self) -> Caps {
        self.state.borrow().caps
    }

    fn node(&self) -> NodeId {
        self.state.borrow().node
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        self.state.borrow_mut().register(bytes)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.state.borrow_mut().deregister(region)
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        self.state.borrow().read_local(region, offset, out)
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        self.state.borrow_mut().create_qp()
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        self.state.borrow_mut().connect_qp(local, remote)
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        self.state.borrow_mut().post_send(qp, wrs)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.state.borrow_mut().poll_cq(out, max)
    }

    fn wait(&mut self, timeout: Duration) -> bool {
        self.state.borrow_mut().wait(timeout)
    }
}

/// The end of a bounded wait on the real clock (`None`: so far away that `Instant` cannot hold it).
struct Deadline(Option<Instant>);

impl Deadline {
    fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// The time left, or `None` once it has passed.
    fn left(&self) -> Option<Duration> {
        match self.0 {
            Some(deadline) => deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero()),
            None => Some(Duration::MAX),
        }
    }
}

/// A plug-in as a [`Transport`] of the certification kit: endpoints from [`Plugin::open`], time passing through
/// the plug-in's `wait` (or polling), every wait bounded.
#[derive(Debug)]
pub struct PluginTransport {
    plugin: Plugin,
    /// The endpoints opened since the last reset, while their owners keep them.
    endpoints: Vec<Weak<RefCell<EndpointState>>>,
    settle_timeout: Duration,
}

impl PluginTransport {
    /// The transport of a loaded plug-in, settling within 5 s.
    pub fn new(plugin: Plugin) -> PluginTransport {
        PluginTransport { plugin, endpoints: Vec::new(), settle_timeout: SETTLE_TIMEOUT }
    }

    /// Loads the plug-in at `path` ([`Plugin::load`]) as a transport.
    pub fn load(path: impl AsRef<Path>) -> Result<PluginTransport, PluginError> {
        Plugin::load(path).map(PluginTransport::new)
    }

    /// The longest [`Transport::settle`] waits for the plug-in's completions.
    pub fn with_settle_timeout(mut self, timeout: Duration) -> PluginTransport {
        self.settle_timeout = timeout;
        self
    }

    /// The plug-in behind this transport.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// A fresh endpoint for `node` ([`Plugin::open`]), remembered until [`Transport::reset`] closes it.
    pub fn open_endpoint(&mut self, node: NodeId, caps: Caps) -> Result<PluginEndpoint, FabricError> {
        let endpoint = self.plugin.open(node, caps)?;
        self.endpoints.retain(|weak| weak.strong_count() > 0);
        self.endpoints.push(Rc::downgrade(&endpoint.state));
        Ok(endpoint)
    }

    /// Every fault the plug-in made on the endpoints still alive ([`PluginEndpoint::faults`]).
    pub fn faults(&self) -> Vec<String> {
        self.live().iter().flat_map(|state| state.borrow().faults.clone()).collect()
    }

    fn live(&self) -> Vec<Rc<RefCell<EndpointState>>> {
        self.endpoints.iter().filter_map(Weak::upgrade).collect()
    }

    /// Waits up to `budget` on the live endpoints (shared between them); whether a completion may be ready.
    fn wait_all(&self, budget: Duration) -> bool {
        let live = self.live();
        if live.is_empty() {
            std::thread::sleep(budget);
            return false;
        }
        let share = budget / live.len() as u32;
        live.iter().any(|state| state.borrow_mut().wait(share))
    }
}

impl Transport for PluginTransport {
    fn identity(&self) -> Identity {
        self.plugin.identity()
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        let endpoint = self.open_endpoint(node, caps).map_err(|error| TransportError::Open(error.to_string()))?;
        Ok(Box::new(endpoint))
    }

    fn step(&mut self) {
        self.wait_all(STEP);
    }

    fn settle(&mut self) {
        let deadline = Deadline::after(self.settle_timeout);
        loop {
            let live = self.live();
            let mut settled = true;
            for state in &live {
                let mut state = state.borrow_mut();
                state.fetch(usize::MAX);
                settled &= state.raw.is_none() || state.settled();
            }
            match deadline.left() {
                Some(left) if !settled => {
                    self.wait_all(STEP.min(left));
                }
                _ => return,
            }
        }
    }

    fn reset(&mut self) {
        for state in self.live() {
            state.borrow_mut().close();
        }
        self.endpoints.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_text_needs_a_name_and_a_version() {
        let info = parse_info("name=x\nversion=1.2\n\ndevice = mem\n").unwrap();
        assert_eq!((info.name.as_str(), info.version.as_str()), ("x", "1.2"));
        assert_eq!(info.facts, BTreeMap::from([("device".to_owned(), "mem".to_owned())]));
        assert_eq!(parse_info("version=1").unwrap_err(), "it has no `name=` line");
        assert_eq!(parse_info("name=\nversion=1").unwrap_err(), "it has no `name=` line");
        assert_eq!(parse_info("name=x").unwrap_err(), "it has no `version=` line");
        assert_eq!(parse_info("name=x\njunk").unwrap_err(), "line 2 `junk` is not key=value");
    }

    #[test]
    fn a_deadline_too_far_for_the_clock_never_passes_and_a_zero_one_has() {
        assert!(Deadline::after(Duration::MAX).left().is_some());
        assert!(Deadline::after(Duration::ZERO).left().is_none());
        assert!(Deadline::after(Duration::from_secs(60)).left().is_some_and(|left| left <= Duration::from_secs(60)));
    }

    #[test]
    fn the_mirrored_structs_have_the_header_layout() {
        use std::mem::size_of;
        assert_eq!(size_of::<RawCaps>(), 24);
        assert_eq!(size_of::<RawRegion>(), 24);
        assert_eq!(size_of::<RawQpInfo>(), 28);
        assert_eq!(size_of::<RawSge>(), 24);
        assert_eq!(size_of::<RawWorkRequest>(), 40);
        assert_eq!(size_of::<RawCompletion>(), 32);
        assert_eq!(size_of::<RawTable>(), 8 + 12 * size_of::<usize>());
    }
}
