//! Memory for a quantised model's repacked weights that the kernel may back with 2 MiB pages.
//!
//! A batch-1 decode step reads every weight once (96 MB a token for SmolLM2-135M in Q4_1). On
//! 4 KiB pages that is some 24,000 address translations a token, each a miss in the TLB that
//! the weights streamed before it emptied; on 2 MiB pages, about 50. Linux backs anonymous
//! memory with transparent huge pages only where the memory asks for them when its setting is
//! `madvise` (a common default), so the weights ask for them here (docs/performance.md
//! measures the difference).
//!
//! Invariants:
//! - Weights are carved out of chunks of at least [`CHUNK`] bytes, aligned to [`HUGE_PAGE`], that
//!   ask for huge pages before any of their bytes is touched; a chunk is freed when the last
//!   [`WeightBytes`] carved from it is dropped.
//! - Each carved range is handed out once, zeroed, to the closure that fills it, before anything
//!   else can read it; ranges never overlap, and each starts on a cache line.
//! - Where huge pages cannot be asked for (another OS, a kernel without them, the setting
//!   `never`), the same memory works on small pages; nothing else changes.

use std::alloc::Layout;
use std::ops::{Deref, Range};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, Weak};

/// The size and alignment of a transparent huge page on x86-64 (and of the default on arm64).
const HUGE_PAGE: usize = 2 << 20;
/// Bytes of a chunk, unless one weight needs more. Only the pages a chunk's weights touch take
/// memory: the rest of the huge page that the last one ends in, at most 2 MiB a chunk, under 2%
/// of it; the untouched tail costs address space only.
const CHUNK: usize = 128 << 20;
/// Where each carved range starts: on a cache line, as the kernels' loads prefer.
const LINE: usize = 64;

/// Bytes of a weight, read-only once filled, in a chunk that asked for huge pages.
pub(crate) struct WeightBytes {
    chunk: Arc<Chunk>,
    range: Range<usize>,
}

impl WeightBytes {
    /// `len` bytes, zeroed and then filled by `fill`.
    pub(crate) fn new(len: usize, fill: impl FnOnce(&mut [u8])) -> Self {
        let (chunk, range) = carve(len);
        // SAFETY: `carve` hands each range of a chunk out once, so nothing else refers to these
        // bytes until `fill` returns; the range lies inside the chunk's allocation, and is
        // zeroed before it is read as bytes.
        let bytes = unsafe {
            let start = chunk.base.as_ptr().add(range.start);
            start.write_bytes(0, len);
            std::slice::from_raw_parts_mut(start, len)
        };
        fill(bytes);
        Self { chunk, range }
    }
}

impl Deref for WeightBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the range lies inside the chunk, which lives as long as `self`, and was
        // filled before `new` returned; nothing writes it afterwards.
        unsafe {
            std::slice::from_raw_parts(
                self.chunk.base.as_ptr().add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl Clone for WeightBytes {
    /// A second owner of the same bytes (they are never written again).
    fn clone(&self) -> Self {
        Self {
            chunk: Arc::clone(&self.chunk),
            range: self.range.clone(),
        }
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.range.len())
    }
}

/// One allocation that asked for huge pages.
struct Chunk {
    base: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a chunk is plain memory; every range of it is written once, by the one thread that
// carved it, before it is shared (module invariants).
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.next_multiple_of(HUGE_PAGE), HUGE_PAGE)
            .expect("a weight's bytes fit in the address space");
        // SAFETY: the layout's size is at least one huge page, never zero.
        let base = unsafe { std::alloc::alloc(layout) };
        let Some(base) = NonNull::new(base) else {
            std::alloc::handle_alloc_error(layout)
        };
        advise_huge_pages(base, layout.size());
        Self { base, layout }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `Chunk::new` with this layout, and freed only here.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// The chunk being carved and how much of it is taken. Held weakly: once every weight of a
/// chunk is dropped, so is the chunk, and the next weight starts a new one.
static CURRENT: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// A fresh range of `len` bytes.
fn carve(len: usize) -> (Arc<Chunk>, Range<usize>) {
    let mut current = CURRENT.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((chunk, used)) = current.as_mut()
        && let Some(chunk) = chunk.upgrade()
    {
        let start = used.next_multiple_of(LINE);
        if start + len <= chunk.layout.size() {
            *used = start + len;
            return (chunk, start..start + len);
        }
    }
    let chunk = Arc::new(Chunk::new(len.max(CHUNK)));
    *current = Some((Arc::downgrade(&chunk), len));
    (chunk, 0..len)
}

/// Asks the kernel to back `len` bytes at `base` (page-aligned, not yet touched) with
/// transparent huge pages. A hint: refused, it leaves small pages, which work the same.
fn advise_huge_pages(base: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: the range is one allocation of ours; the advice changes how its pages are backed,
    // not its contents or its mapping.
    unsafe {
        libc::madvise(base.as_ptr().cast(), len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (base, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A carved weight's mapping carries the advice (`hg` in its `VmFlags`) wherever the kernel
    /// has transparent huge pages, whatever the system's setting, and where the setting backs
    /// memory that asks for them (`always` or `madvise`) the weight lies on them once filled;
    /// both read from the process's own memory map. On a kernel without them there is nothing
    /// to check.
    #[cfg(target_os = "linux")]
    #[test]
    fn carved_weights_lie_on_huge_pages_where_the_system_offers_them() {
        let Ok(setting) = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        else {
            eprintln!("this kernel has no transparent huge pages: nothing to check");
            return;
        };
        let weight = WeightBytes::new(2 * HUGE_PAGE, |bytes| bytes.fill(1));
        let at = weight.as_ptr() as usize;
        let maps = std::fs::read_to_string("/proc/self/smaps").expect("the process's memory map");
        // A mapping's lines start with its address range (`start-end`, in hex), then list its
        // fields, `AnonHugePages` and, last, `VmFlags` among them.
        let range = |token: &str| -> Option<Range<usize>> {
            let (start, end) = token.split_once('-')?;
            Some(usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?)
        };
        let mut inside = false;
        let mut huge_kb = None;
        let mut flags = None;
        for line in maps.lines() {
            if let Some(mapping) = line.split_whitespace().next().and_then(range) {
                inside = mapping.contains(&at);
            } else if inside && let Some(value) = line.strip_prefix("AnonHugePages:") {
                huge_kb = value
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<usize>()
                    .ok();
            } else if inside && let Some(value) = line.strip_prefix("VmFlags:") {
                flags = Some(
                    value
                        .split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>(),
                );
                break;
            }
        }
        let flags = flags.expect("the weight's mapping in /proc/self/smaps");
        assert!(
            flags.iter().any(|f| f == "hg"),
            "the weight's mapping did not ask for huge pages: flags {flags:?}"
        );
        if !(setting.contains("[always]") || setting.contains("[madvise]")) {
            eprintln!("transparent huge pages are off here ({setting:?}): the advice is all");
            return;
        }
        let huge_kb = huge_kb.expect("AnonHugePages in the weight's mapping");
        assert!(
            huge_kb >= HUGE_PAGE / 1024,
            "{huge_kb} kB of huge pages under the weight's mapping (setting {setting:?})"
        );
    }

    /// Weights carved one after another hold what each was filled with, start on cache lines
    /// and never overlap, across a chunk's end and for a weight larger than a chunk.
    #[test]
    fn carved_weights_keep_their_bytes_apart() {
        let lens = [
            1usize,
            100,
            4096,
            CHUNK - 5000,
            3 * HUGE_PAGE,
            CHUNK + 7,
            0,
            65,
        ];
        // Each weight's own byte: one written over another's shows as the wrong byte there.
        let mark = |i: usize| (i + 1) as u8;
        let weights: Vec<WeightBytes> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                WeightBytes::new(len, |bytes| {
                    assert!(bytes.iter().all(|&b| b == 0), "weight {i} starts zeroed");
                    bytes.fill(mark(i));
                })
            })
            .collect();
        for (i, (weight, &len)) in weights.iter().zip(&lens).enumerate() {
            assert_eq!(weight.len(), len, "weight {i}'s length");
            assert_eq!(
                weight.as_ptr() as usize % LINE,
                0,
                "weight {i} starts on a line"
            );
            assert!(
                weight.iter().all(|&b| b == mark(i)),
                "weight {i} keeps its bytes"
            );
        }
        let mut spans: Vec<Range<usize>> = weights
            .iter()
            .map(|w| w.as_ptr() as usize..w.as_ptr() as usize + w.len())
            .collect();
        spans.sort_by_key(|s| s.start);
        for pair in spans.windows(2) {
            assert!(pair[0].end <= pair[1].start, "{pair:?} overlap");
        }
    }
}
