//! The per-sequence KV cache and the batch layout of one forward pass.
//!
//! Every sequence owns its cache ([`SeqCache`]), holding only its real tokens, one slot per
//! attention invocation of a forward pass. A batch is assembled for each forward pass from
//! whichever sequences are running, so sequences can join and leave between decode steps
//! (continuous batching). Rows are left-padded to the longest new input; the additive
//! attention mask hides padding, future tokens, and, for prefix-LM models, lets the prompt
//! block attend to itself in both directions.

use std::sync::{Arc, OnceLock};

use candle_core::{D, DType, Device, Result, Tensor};

use crate::Logits;
use crate::layers::RopeLayout;

/// The keys and values of one sequence, per attention slot.
///
/// Each slot keeps `[1, kv_heads, capacity, head_dim]` buffers whose first `len` positions hold
/// the cache. An append writes its tokens in place and doubles the capacity when the buffers are
/// full, so a decode step copies its one new token rather than the whole cache, and growing to
/// `n` tokens copies at most `2n`. The buffers hold the cache's own dtype (f16 for a GGUF model
/// on the CPU, [`crate::ModelInfo::cache_dtype`]): an append rounds to it, and attention reads
/// the rounded values back in the pass's dtype. Not `Clone`: two caches sharing buffers would
/// write over each other.
#[derive(Debug)]
pub struct SeqCache {
    slots: Vec<Option<SlotBuffers>>,
    len: usize,
    dtype: DType,
    /// Tokens the caller expects to decode after the prompt, if it said
    /// ([`SeqCache::with_decode_room`]).
    decode_room: Option<usize>,
}

#[derive(Debug)]
struct SlotBuffers {
    keys: Tensor,
    values: Tensor,
    len: usize,
}

/// The smallest capacity a slot allocates, in tokens: short decodes never reallocate.
const MIN_CAPACITY: usize = 64;

/// A slot's capacity at its first append of `new` tokens: room for as many again, or for the
/// decode steps the caller expects (`decode_room`) where those are fewer. A prompt's pass is
/// followed by decode steps, and a buffer sized to the prompt alone would be copied whole into
/// a doubled one at the very first step (on the calling thread, while the team waits); room for
/// as many again is the capacity that first step would have grown it to. A request for 32
/// tokens after a 128-token prompt would otherwise allocate, and zero, 96 positions of every
/// slot that it never reaches.
fn first_capacity(new: usize, decode_room: Option<usize>) -> usize {
    (new + decode_room.map_or(new, |room| room.min(new))).max(MIN_CAPACITY)
}

impl SlotBuffers {
    /// Room for `needed` tokens at least, keeping what is cached.
    fn reserve(&mut self, needed: usize) -> Result<()> {
        let capacity = self.keys.dim(2)?;
        if needed <= capacity {
            return Ok(());
        }
        let capacity = needed.max(2 * capacity);
        self.keys = grown(&self.keys, self.len, capacity)?;
        self.values = grown(&self.values, self.len, capacity)?;
        Ok(())
    }
}

/// A `[b, h, capacity, d]` buffer of `t`'s dtype holding the first `len` positions of `t`.
fn grown(t: &Tensor, len: usize, capacity: usize) -> Result<Tensor> {
    let (b, h, _, d) = t.dims4()?;
    let buffer = Tensor::zeros((b, h, capacity, d), t.dtype(), t.device())?;
    if len > 0 {
        buffer.slice_set(&t.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
    }
    Ok(buffer)
}

impl SeqCache {
    /// An empty cache of the model's slots, holding its cache dtype.
    pub fn for_model(info: &crate::ModelInfo) -> Self {
        Self::new(info.cache_slots, info.cache_dtype)
    }

    /// An empty cache of `num_slots` slots whose buffers hold `dtype`.
    pub fn new(num_slots: usize, dtype: DType) -> Self {
        Self {
            slots: (0..num_slots).map(|_| None).collect(),
            len: 0,
            dtype,
            decode_room: None,
        }
    }

    /// The same cache told that at most `tokens` decode steps follow the prompt: its first
    /// buffers hold the prompt and those steps where that is less than the default room for as
    /// many again as the prompt. A longer generation grows the buffers as before.
    pub fn with_decode_room(self, tokens: usize) -> Self {
        Self {
            decode_room: Some(tokens),
            ..self
        }
    }

    /// Drops what a pass appended to the slots and never committed: a pass that failed part
    /// way through its layers leaves some slots a step ahead of the others, and a retried step
    /// would read those positions as history.
    fn discard_uncommitted(&mut self) {
        for buffers in self.slots.iter_mut().flatten() {
            buffers.len = buffers.len.min(self.len);
        }
    }

    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `slot`'s buffers with room for `new` more positions, made empty (`[batch, heads,
    /// capacity, head_dim]` in the cache's dtype on `device`) on the slot's first append.
    fn room_for(
        &mut self,
        slot: usize,
        new: usize,
        (batch, heads, head_dim): (usize, usize, usize),
        device: &Device,
    ) -> Result<&mut SlotBuffers> {
        let (dtype, slots, room) = (self.dtype, self.slots.len(), self.decode_room);
        let Some(entry) = self.slots.get_mut(slot) else {
            candle_core::bail!("KV-cache slot {slot} out of range ({slots})")
        };
        let buffers = match entry {
            Some(buffers) => buffers,
            None => {
                let shape = (batch, heads, first_capacity(new, room), head_dim);
                entry.insert(SlotBuffers {
                    keys: Tensor::zeros(shape, dtype, device)?,
                    values: Tensor::zeros(shape, dtype, device)?,
                    len: 0,
                })
            }
        };
        buffers.reserve(buffers.len + new)?;
        Ok(buffers)
    }

    /// Appends `[1, kv_heads, new, head_dim]` keys and values to `slot`, rounded to the cache's
    /// dtype, and returns the slot's whole cache (views of its buffers, in the cache's dtype).
    fn append(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (&k.to_dtype(self.dtype)?, &v.to_dtype(self.dtype)?);
        let (b, heads, new, head_dim) = k.dims4()?;
        let buffers = self.room_for(slot, new, (b, heads, head_dim), k.device())?;
        buffers.keys.slice_set(&k.contiguous()?, 2, buffers.len)?;
        buffers.values.slice_set(&v.contiguous()?, 2, buffers.len)?;
        buffers.len += new;
        Ok((
            buffers.keys.narrow(2, 0, buffers.len)?,
            buffers.values.narrow(2, 0, buffers.len)?,
        ))
    }

    /// Appends one position's keys and values (`[kv_heads, head_dim]` each, f32) to `slot`,
    /// rounded to the cache's dtype as [`Self::append`] rounds them, written into the buffers
    /// in place.
    fn append_position(
        &mut self,
        slot: usize,
        (k, v): (&[f32], &[f32]),
        kv_heads: usize,
    ) -> Result<()> {
        if kv_heads == 0 || k.len() != v.len() || !k.len().is_multiple_of(kv_heads) {
            candle_core::bail!(
                "KV cache: {} keys and {} values over {kv_heads} heads",
                k.len(),
                v.len()
            )
        }
        let head_dim = k.len() / kv_heads;
        let buffers = self.room_for(slot, 1, (1, kv_heads, head_dim), &Device::Cpu)?;
        let position = buffers.len;
        buffers
            .keys
            .inplace_op1(&InPlace(WritePosition { rows: k, position }))?;
        buffers
            .values
            .inplace_op1(&InPlace(WritePosition { rows: v, position }))?;
        buffers.len += 1;
        Ok(())
    }

    /// Appends a pass's new positions of one sequence straight from its attention input
    /// projection: the keys rotated and the values as they are, both rounded to the cache's
    /// dtype, written into the buffers in place on the thread team, one KV head per unit. The
    /// same values [`Self::append`] writes from the rotated keys and the values as tensors,
    /// without copying either into a tensor first.
    ///
    /// A slot's first append makes its buffers from the rows, written once, rather than
    /// zeroing them and then writing: a batch-8 prompt's pass of `models/sample` zeroed 48 MB of
    /// buffers on the calling thread while the team waited.
    fn append_projected(&mut self, slot: usize, rows: &ProjectedRows<'_>) -> Result<()> {
        let new = rows.positions()?;
        if let Some(entry @ None) = self.slots.get_mut(slot) {
            let capacity = first_capacity(new, self.decode_room);
            let buffer = |part| match self.dtype {
                DType::F32 => filled_buffer::<f32>(rows, part, capacity),
                DType::F16 => filled_buffer::<half::f16>(rows, part, capacity),
                dtype => candle_core::bail!("KV cache: buffers hold f32 or f16, not {dtype:?}"),
            };
            *entry = Some(SlotBuffers {
                keys: buffer(Part::Keys)?,
                values: buffer(Part::Values)?,
                len: new,
            });
            return Ok(());
        }
        let shape = (1, rows.columns.kv_heads, rows.columns.head_dim);
        let buffers = self.room_for(slot, new, shape, &Device::Cpu)?;
        let position = buffers.len;
        for part in [Part::Keys, Part::Values] {
            let write = InPlace(WriteProjected {
                rows,
                part,
                position,
            });
            match part {
                Part::Keys => buffers.keys.inplace_op1(&write)?,
                Part::Values => buffers.values.inplace_op1(&write)?,
            }
        }
        buffers.len += new;
        Ok(())
    }
}

/// Where an attention input projection keeps a position's keys and values: each position a
/// row of `width` values, its key heads from column `keys_at` and its value heads from
/// `values_at`, `head_dim` values a head; the keys rotated in `layout` before they are cached.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProjectionColumns {
    pub width: usize,
    pub keys_at: usize,
    pub values_at: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layout: RopeLayout,
}

/// One sequence's new positions of a projection laid out as `columns` says, with each
/// position's rotary angles (`head_dim / 2` cosines and sines).
struct ProjectedRows<'a> {
    proj: &'a [f32],
    cos: &'a [f32],
    sin: &'a [f32],
    columns: ProjectionColumns,
}

impl ProjectedRows<'_> {
    /// How many positions the rows hold, once their parts are checked against each other.
    fn positions(&self) -> Result<usize> {
        let c = &self.columns;
        let (width, d, half) = (c.width, c.head_dim, c.head_dim / 2);
        let heads_end = |at: usize| at + c.kv_heads * d;
        let fits = width > 0
            && d % 2 == 0
            && self.proj.len().is_multiple_of(width)
            && heads_end(c.keys_at) <= width
            && heads_end(c.values_at) <= width;
        let new = if fits { self.proj.len() / width } else { 0 };
        if !fits || self.cos.len() != new * half || self.sin.len() != new * half {
            candle_core::bail!("KV cache: a projection whose heads or angles do not fit its rows")
        }
        Ok(new)
    }
}

/// Which of a slot's two buffers a write fills.
#[derive(Clone, Copy)]
enum Part {
    Keys,
    Values,
}

/// A value a cache buffer holds: f32, or f16 (a GGUF model's cache on the CPU).
trait CacheValue: candle_core::WithDType {
    /// `x` rounded to this dtype as `Tensor::to_dtype` rounds (to nearest, ties to even).
    fn rounded(x: f32) -> Self;

    /// `x` into `out`, rounded.
    fn store(out: &mut [Self], x: &[f32]) {
        for (out, &x) in out.iter_mut().zip(x) {
            *out = Self::rounded(x);
        }
    }
}

impl CacheValue for f32 {
    fn rounded(x: f32) -> f32 {
        x
    }
}

impl CacheValue for half::f16 {
    fn rounded(x: f32) -> half::f16 {
        half::f16::from_f32(x)
    }

    /// Eight values an instruction where the CPU has F16C (`half` asks at run time), where
    /// `rounded` costs a call and a feature check for each value.
    fn store(out: &mut [half::f16], x: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        let n = out.len().min(x.len());
        out[..n].convert_from_f32_slice(&x[..n]);
    }
}

/// A new contiguous `[1, kv_heads, capacity, head_dim]` buffer holding `rows`' keys (rotated)
/// or values at its first positions and zeros after them, each head's part written once, on
/// the thread team.
fn filled_buffer<T: CacheValue>(
    rows: &ProjectedRows<'_>,
    part: Part,
    capacity: usize,
) -> Result<Tensor> {
    let new = rows.positions()?;
    let (heads, d) = (rows.columns.kv_heads, rows.columns.head_dim);
    if new > capacity {
        candle_core::bail!("KV cache: {new} positions for a buffer of {capacity}")
    }
    let len = heads * capacity * d;
    let mut buffer: Vec<T> = Vec::with_capacity(len);
    crate::team::chunks_in_parallel(
        &mut buffer.spare_capacity_mut()[..len],
        capacity * d,
        |h, head| {
            let (written, rest) = head.split_at_mut(new * d);
            // Value by value, not by `CacheValue::store`: these values are not yet initialised,
            // which `half`'s slice conversion cannot write into (docs/performance.md weighs it).
            rows.each_position(h, part, |t, x| {
                for (out, &x) in written[t * d..][..d].iter_mut().zip(x) {
                    out.write(T::rounded(x));
                }
            });
            rest.fill(std::mem::MaybeUninit::new(T::rounded(0.0)));
        },
    );
    // SAFETY: the chunks cover the first `len` values, one head's `capacity · head_dim` each,
    // and each chunk was written in full: `each_position` hands `put` each of the rows' `new`
    // positions once (`positions` checked that the rows hold whole positions), `head_dim`
    // values each, and the zeros fill the rest of the chunk.
    unsafe { buffer.set_len(len) };
    Tensor::from_vec(buffer, (1, heads, capacity, d), &Device::Cpu)
}

/// A write into a cache buffer in place, whatever dtype it holds; [`InPlace`] runs it.
trait CacheWrite {
    /// The op's name, for candle.
    const NAME: &'static str;

    /// Writes into `values`, the `[heads, capacity, head_dim]` values of a contiguous buffer
    /// (`dims`).
    fn write<T: CacheValue>(&self, values: &mut [T], dims: (usize, usize, usize)) -> Result<()>;
}

/// A [`CacheWrite`] as candle's in-place op on a contiguous `[1, heads, capacity, head_dim]`
/// cache buffer.
struct InPlace<W>(W);

impl<W: CacheWrite> candle_core::InplaceOp1 for InPlace<W> {
    fn name(&self) -> &'static str {
        W::NAME
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> Result<()> {
        let (_, heads, capacity, head_dim) = layout.shape().dims4()?;
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("KV cache: a buffer is not contiguous")
        };
        let dims = (heads, capacity, head_dim);
        match storage {
            candle_core::CpuStorage::F32(buffer) if buffer.len() >= end => {
                self.0.write(&mut buffer[start..end], dims)
            }
            candle_core::CpuStorage::F16(buffer) if buffer.len() >= end => {
                self.0.write(&mut buffer[start..end], dims)
            }
            _ => candle_core::bail!("KV cache: buffers hold f32 or f16"),
        }
    }
}

/// Writes [`ProjectedRows`]' keys (rotated) or values at `position` of a contiguous `[1,
/// kv_heads, capacity, head_dim]` cache buffer, converted to the buffer's dtype.
struct WriteProjected<'a> {
    rows: &'a ProjectedRows<'a>,
    part: Part,
    position: usize,
}

impl ProjectedRows<'_> {
    /// `put(t, x)` for each position `t` in order, `x` its `head_dim` values of head `h`'s
    /// keys (rotated) or values.
    fn each_position(&self, h: usize, part: Part, mut put: impl FnMut(usize, &[f32])) {
        let columns = &self.columns;
        let (d, half) = (columns.head_dim, columns.head_dim / 2);
        let mut rotated = vec![0f32; d];
        let at = match part {
            Part::Keys => columns.keys_at,
            Part::Values => columns.values_at,
        } + h * d;
        for (t, row) in self.proj.chunks_exact(columns.width).enumerate() {
            crate::fused::prefetch_head_ahead(self.proj, columns.width, t, at, d);
            let head = &row[at..][..d];
            match part {
                Part::Keys => {
                    let (cos, sin) = (&self.cos[t * half..][..half], &self.sin[t * half..][..half]);
                    crate::fused::rotate(columns.layout, head, cos, sin, &mut rotated);
                    put(t, &rotated);
                }
                Part::Values => put(t, head),
            }
        }
    }
}

impl CacheWrite for WriteProjected<'_> {
    const NAME: &'static str = "kv-cache-write-projected";

    fn write<T: CacheValue>(
        &self,
        values: &mut [T],
        (heads, capacity, head_dim): (usize, usize, usize),
    ) -> Result<()> {
        let new = self.rows.positions()?;
        if heads != self.rows.columns.kv_heads
            || head_dim != self.rows.columns.head_dim
            || self.position + new > capacity
        {
            candle_core::bail!("KV cache: positions that do not fit their buffer")
        }
        crate::team::chunks_in_parallel(values, capacity * head_dim, |h, head| {
            let at = |t: usize| (self.position + t) * head_dim;
            self.rows.each_position(h, self.part, |t, x| {
                T::store(&mut head[at(t)..][..head_dim], x);
            });
        });
        Ok(())
    }
}

/// Writes `rows` (one row per head, `[heads, head_dim]`) at `position` of a contiguous
/// `[1, heads, capacity, head_dim]` cache buffer, converted to the buffer's dtype.
struct WritePosition<'a> {
    rows: &'a [f32],
    position: usize,
}

impl CacheWrite for WritePosition<'_> {
    const NAME: &'static str = "kv-cache-write-position";

    fn write<T: CacheValue>(
        &self,
        values: &mut [T],
        (heads, capacity, head_dim): (usize, usize, usize),
    ) -> Result<()> {
        if self.rows.len() != heads * head_dim || self.position >= capacity {
            candle_core::bail!("KV cache: a position that does not fit its buffer")
        }
        for (h, row) in self.rows.chunks_exact(head_dim).enumerate() {
            T::store(
                &mut values[(h * capacity + self.position) * head_dim..][..head_dim],
                row,
            );
        }
        Ok(())
    }
}

/// Where each row of a batch stands: how much padding precedes its new tokens, how many
/// tokens it already has cached, and how many of its new tokens form a bidirectional block.
#[derive(Clone, Debug)]
pub struct RowLayout {
    pub padding: usize,
    pub past: usize,
    /// Leading new tokens that attend to each other in both directions (prefix-LM prompt).
    /// Only meaningful on a row's first pass (`past == 0`), as in transformers.
    pub block: usize,
}

/// One forward pass: token ids, their positions, the mask, and the caches to extend.
pub struct ForwardBatch<'c> {
    pub input_ids: Tensor,
    /// Absolute position of every input token, `[batch * seq_len]` as u32 (0 for padding).
    pub positions: Tensor,
    /// Additive mask `[batch, 1, seq_len, kv_len]`, or `None` when nothing needs hiding.
    pub mask: Option<Tensor>,
    pub logits: Logits,
    rows: Vec<RowLayout>,
    caches: Vec<&'c mut SeqCache>,
    seq_len: usize,
    kv_len: usize,
    /// `mask`'s values in f32 on the host, read once for every attention op of the pass.
    mask_values: OnceLock<Option<Arc<[f32]>>>,
}

impl<'c> ForwardBatch<'c> {
    /// A batch of new tokens per row. With `caches` (one per row), the pass extends them;
    /// with an empty `caches`, it is a full pass over `tokens` alone. `blocks[i]` is the length of
    /// row `i`'s bidirectional prefix (0 for a causal row).
    pub fn new(
        tokens: &[Vec<u32>],
        blocks: &[usize],
        mut caches: Vec<&'c mut SeqCache>,
        logits: Logits,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let batch = tokens.len();
        if batch == 0 || tokens.iter().any(|t| t.is_empty()) {
            candle_core::bail!("a forward batch needs at least one row and one token per row")
        }
        if blocks.len() != batch || !(caches.is_empty() || caches.len() == batch) {
            candle_core::bail!(
                "forward batch: {batch} rows but {} blocks and {} caches",
                blocks.len(),
                caches.len()
            )
        }
        for cache in &mut caches {
            cache.discard_uncommitted();
        }
        let seq_len = tokens.iter().map(Vec::len).max().unwrap_or(0);
        let rows: Vec<RowLayout> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let past = caches.get(i).map_or(0, |c| c.len());
                RowLayout {
                    padding: seq_len - t.len(),
                    past,
                    block: if past == 0 { blocks[i].min(t.len()) } else { 0 },
                }
            })
            .collect();
        let kv_len = rows
            .iter()
            .map(|r| r.past + seq_len - r.padding)
            .max()
            .unwrap_or(0);

        let mut ids = Vec::with_capacity(batch * seq_len);
        let mut positions = Vec::with_capacity(batch * seq_len);
        for (t, row) in tokens.iter().zip(&rows) {
            ids.extend(std::iter::repeat_n(0u32, row.padding));
            ids.extend_from_slice(t);
            positions.extend(std::iter::repeat_n(0u32, row.padding));
            positions.extend((0..t.len()).map(|j| (row.past + j) as u32));
        }
        let input_ids = Tensor::from_vec(ids, (batch, seq_len), device)?;
        let positions = Tensor::from_vec(positions, batch * seq_len, device)?;
        let mask = build_mask(&rows, seq_len, kv_len, device, dtype)?;
        Ok(Self {
            input_ids,
            positions,
            mask,
            logits,
            rows,
            caches,
            seq_len,
            kv_len,
            mask_values: OnceLock::new(),
        })
    }

    /// A full pass with no caches (scoring, training), on the model's device and dtype.
    pub fn full_pass(
        tokens: &[Vec<u32>],
        blocks: &[usize],
        logits: Logits,
        info: &crate::ModelInfo,
    ) -> Result<Self> {
        Self::new(tokens, blocks, Vec::new(), logits, &info.device, info.dtype)
    }

    pub fn batch_size(&self) -> usize {
        self.rows.len()
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    pub fn rows(&self) -> &[RowLayout] {
        &self.rows
    }

    /// Whether this pass runs over its tokens alone, with no cache (scoring, training).
    pub fn is_full_pass(&self) -> bool {
        self.caches.is_empty()
    }

    /// Appends this pass's keys and values (`[batch, kv_heads, seq_len, head_dim]`) to every
    /// row's cache slot and returns the keys and values attention must read, left-padded to a
    /// common length. Without caches, returns the inputs unchanged.
    pub fn attend_to(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.caches.is_empty() {
            return Ok((k.clone(), v.clone()));
        }
        let mut keys = Vec::with_capacity(self.rows.len());
        let mut values = Vec::with_capacity(self.rows.len());
        for (k_all, v_all) in self.append(slot, k, v)? {
            let missing = self.kv_len - k_all.dim(2)?;
            keys.push(pad_left(&k_all.to_dtype(k.dtype())?, missing)?);
            values.push(pad_left(&v_all.to_dtype(v.dtype())?, missing)?);
        }
        if keys.len() == 1 {
            return Ok((keys.remove(0), values.remove(0)));
        }
        Ok((Tensor::cat(&keys, 0)?, Tensor::cat(&values, 0)?))
    }

    /// Appends this pass's keys and values (`[batch, kv_heads, seq_len, head_dim]`) to every
    /// row's cache slot, without the row's left padding, and returns each row's whole slot.
    pub(crate) fn append(
        &mut self,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        self.rows
            .iter()
            .zip(self.caches.iter_mut())
            .enumerate()
            .map(|(i, (row, cache))| {
                let new = self.seq_len - row.padding;
                let k_row = k.narrow(0, i, 1)?.narrow(2, row.padding, new)?;
                let v_row = v.narrow(0, i, 1)?.narrow(2, row.padding, new)?;
                cache.append(slot, &k_row, &v_row)
            })
            .collect()
    }

    /// [`Self::append`] for a pass on the CPU in f32 whose keys and values are columns of the
    /// attention input projection `proj` (`[batch, seq_len, width]`, row-major, `cos` and `sin`
    /// `[batch, seq_len, head_dim / 2]`): each row's new positions go from the projection to its
    /// cache in place ([`SeqCache::append_projected`]). `false`, with nothing written, where a
    /// cache holds neither f32 nor f16: [`Self::append`] serves those.
    pub(crate) fn append_projected(
        &mut self,
        slot: usize,
        (proj, cos, sin): (&[f32], &[f32], &[f32]),
        columns: ProjectionColumns,
    ) -> Result<bool> {
        if !self
            .caches
            .iter()
            .all(|c| matches!(c.dtype, DType::F32 | DType::F16))
        {
            return Ok(false);
        }
        let (s, width, half) = (self.seq_len, columns.width, columns.head_dim / 2);
        if proj.len() != self.rows.len() * s * width
            || cos.len() != self.rows.len() * s * half
            || sin.len() != cos.len()
        {
            candle_core::bail!("KV cache: a projection or angles that do not match the batch")
        }
        for (i, (row, cache)) in self.rows.iter().zip(self.caches.iter_mut()).enumerate() {
            let (first, end) = (i * s + row.padding, (i + 1) * s);
            let rows = ProjectedRows {
                proj: &proj[first * width..end * width],
                cos: &cos[first * half..end * half],
                sin: &sin[first * half..end * half],
                columns,
            };
            cache.append_projected(slot, &rows)?;
        }
        Ok(true)
    }

    /// The mask's values in f32, row-major, copied from the mask once per pass (every layer of a
    /// pass shares the same mask).
    pub(crate) fn mask_values(&self) -> Result<Option<Arc<[f32]>>> {
        if let Some(values) = self.mask_values.get() {
            return Ok(values.clone());
        }
        let values = match &self.mask {
            Some(mask) => Some(
                mask.flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .into(),
            ),
            None => None,
        };
        Ok(self.mask_values.get_or_init(|| values).clone())
    }

    /// Whether every row attends to this pass's tokens alone: a full pass, or every row's first
    /// pass (nothing cached yet), so that the mask is `[batch, 1, seq_len, seq_len]`.
    pub(crate) fn sees_only_its_own_tokens(&self) -> bool {
        self.rows.iter().all(|row| row.past == 0)
    }

    /// The attention of a decode step (one new token per row), read in place from each row's
    /// cache by `decode_attention.rs` after this step's keys and values (`[batch, kv_heads,
    /// 1, head_dim]`) are appended: `[batch, 1, heads, head_dim]` for queries `q` of `[batch,
    /// heads, 1, head_dim]`. `None` where [`Self::attend_to`] and the general path must run:
    /// not a decode step, not f32 on the CPU, or gradients tracked.
    pub fn decode_attention(
        &mut self,
        slot: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let in_place = !self.caches.is_empty()
            && self.seq_len == 1
            && [q, k, v]
                .iter()
                .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op());
        if !in_place {
            return Ok(None);
        }
        let (batch, heads, _, head_dim) = q.dims4()?;
        let kv_heads = k.dim(1)?;
        for (i, cache) in self.caches.iter_mut().enumerate() {
            cache.append(slot, &k.narrow(0, i, 1)?, &v.narrow(0, i, 1)?)?;
        }
        let q = q.contiguous()?;
        let out = {
            let (q_storage, q_layout) = q.storage_and_layout();
            self.attend_cached(
                slot,
                crate::fused::values(crate::fused::cpu_storage(&q_storage)?, q_layout)?,
                crate::decode_attention::Heads {
                    heads,
                    kv_heads,
                    head_dim,
                },
                scale as f32,
            )?
        };
        Tensor::from_vec(out, (batch, 1, heads, head_dim), q.device()).map(Some)
    }

    /// Whether this pass is a decode step: one new position per row, each row with its cache.
    pub(crate) fn is_decode_step(&self) -> bool {
        !self.caches.is_empty() && self.seq_len == 1
    }

    /// Appends one position's keys and values (`[kv_heads, head_dim]` each) to row `row`'s
    /// cache slot, rounded to the cache's dtype and written in place: the values
    /// [`Self::decode_attention`]'s append writes, without a tensor op.
    pub(crate) fn append_position(
        &mut self,
        slot: usize,
        row: usize,
        (k, v): (&[f32], &[f32]),
        kv_heads: usize,
    ) -> Result<()> {
        let Some(cache) = self.caches.get_mut(row) else {
            candle_core::bail!("KV cache: row {row} out of range ({})", self.caches.len())
        };
        cache.append_position(slot, (k, v), kv_heads)
    }

    /// The attention of a decode step whose keys and values are already in every row's cache
    /// `slot`, read in place by `decode_attention.rs`: `q` is `[batch, heads, head_dim]`, and
    /// so is the result.
    pub(crate) fn attend_cached(
        &self,
        slot: usize,
        q: &[f32],
        shape: crate::decode_attention::Heads,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let slots = self
            .caches
            .iter()
            .map(|c| match c.slots.get(slot) {
                Some(Some(buffers)) => Ok(buffers),
                _ => candle_core::bail!("KV cache: slot {slot} holds nothing to attend to"),
            })
            .collect::<Result<Vec<&SlotBuffers>>>()?;
        let storages: Vec<_> = slots
            .iter()
            .map(|s| (s.keys.storage_and_layout(), s.values.storage_and_layout()))
            .collect();
        let mut views = Vec::with_capacity(slots.len());
        for (slot, ((keys, k_layout), (values, v_layout))) in slots.iter().zip(&storages) {
            views.push(crate::decode_attention::CacheView {
                buffers: buffers(
                    (crate::fused::cpu_storage(keys)?, k_layout),
                    (crate::fused::cpu_storage(values)?, v_layout),
                )?,
                capacity: slot.keys.dim(2)?,
                len: slot.len,
            });
        }
        Ok(crate::decode_attention::attend(q, &views, shape, scale))
    }

    /// Records that every cache now holds this pass's tokens. Called once after the pass.
    pub fn commit(&mut self) {
        for (row, cache) in self.rows.iter().zip(self.caches.iter_mut()) {
            cache.len = row.past + self.seq_len - row.padding;
        }
    }
}

/// A slot's contiguous key and value buffers as decode attention reads them, in the dtype the
/// cache stores.
fn buffers<'a>(
    (keys, k_layout): (&'a candle_core::CpuStorage, &candle_core::Layout),
    (values, v_layout): (&'a candle_core::CpuStorage, &candle_core::Layout),
) -> Result<crate::decode_attention::Buffers<'a>> {
    use crate::decode_attention::Buffers;
    use crate::fused::values_of;
    match candle_core::backend::BackendStorage::dtype(keys) {
        DType::F32 => Ok(Buffers::F32 {
            keys: values_of(keys, k_layout)?,
            values: values_of(values, v_layout)?,
        }),
        DType::F16 => Ok(Buffers::F16 {
            keys: values_of(keys, k_layout)?,
            values: values_of(values, v_layout)?,
        }),
        other => candle_core::bail!("KV cache: decode attention reads f32 or f16, not {other:?}"),
    }
}

fn pad_left(t: &Tensor, missing: usize) -> Result<Tensor> {
    if missing == 0 {
        return Ok(t.clone());
    }
    let (b, h, _, d) = t.dims4()?;
    let zeros = Tensor::zeros((b, h, missing, d), t.dtype(), t.device())?;
    Tensor::cat(&[&zeros, t], 2)
}

/// The additive mask for a batch, or `None` when every query may see every key.
///
/// Key `t` of row `i` is that row's token number `t - (kv_len - total_i)`; query `j` is its token
/// number `past_i + j - padding_i`. A query sees a key when the key is real and not in its future,
/// or when both lie inside the row's bidirectional block. Hidden entries get the dtype's minimum
/// (as transformers does) rather than -inf, so a padding row's softmax stays finite.
fn build_mask(
    rows: &[RowLayout],
    seq_len: usize,
    kv_len: usize,
    device: &Device,
    dtype: DType,
) -> Result<Option<Tensor>> {
    let mut allowed = vec![true; rows.len() * seq_len * kv_len];
    let mut any_hidden = false;
    for (i, row) in rows.iter().enumerate() {
        let total = row.past + seq_len - row.padding;
        let key_start = kv_len - total;
        for j in 0..seq_len {
            for t in 0..kv_len {
                let visible = j >= row.padding && t >= key_start && {
                    let query = row.past + j - row.padding;
                    let key = t - key_start;
                    key <= query || (key < row.block && query < row.block)
                };
                if !visible {
                    allowed[(i * seq_len + j) * kv_len + t] = false;
                    any_hidden = true;
                }
            }
        }
    }
    if !any_hidden {
        return Ok(None);
    }
    let hidden = match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_4e38,
        _ => f32::MIN,
    };
    let values: Vec<f32> = allowed
        .iter()
        .map(|&a| if a { 0.0 } else { hidden })
        .collect();
    let mask = Tensor::from_vec(values, (rows.len(), 1, seq_len, kv_len), device)?;
    mask.to_dtype(dtype).map(Some)
}

/// Softmax over the last dimension: on the CPU in f32 our fused kernel (vectorised `exp`, and a
/// backward pass when gradients are tracked); elsewhere candle's fused kernel for inference and
/// the composed form for training.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        Ok(x.contiguous()?.apply_op1(crate::fused::SoftmaxOp)?)
    } else if !x.track_op() {
        candle_nn::ops::softmax_last_dim(x)
    } else {
        candle_nn::ops::softmax(x, D::Minus1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn visible(mask: &Option<Tensor>, b: usize, j: usize, t: usize) -> bool {
        match mask {
            None => true,
            Some(m) => {
                m.get(b)
                    .unwrap()
                    .get(0)
                    .unwrap()
                    .get(j)
                    .unwrap()
                    .get(t)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    == 0.0
            }
        }
    }

    /// A prompt, then single tokens past the first capacity and past a doubling: what the cache
    /// returns is always every appended token in order, and nothing else.
    #[test]
    fn appends_in_place_keep_every_token_across_growth() {
        let device = Device::Cpu;
        let token = |start: usize, count: usize| {
            let values: Vec<f32> = (start * 6..(start + count) * 6).map(|v| v as f32).collect();
            // [1, kv_heads 2, count, head_dim 3], token t's values all derived from t.
            Tensor::from_vec(values, (1, count, 2, 3), &device)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
        };
        let mut cache = SeqCache::new(2, DType::F32);
        let mut appended = vec![token(0, 5)];
        let (k, _) = cache
            .append(1, &appended[0], &(&appended[0] * 2.0).unwrap())
            .unwrap();
        assert_eq!(k.dims(), &[1, 2, 5, 3]);
        for t in 5..2 * MIN_CAPACITY + 7 {
            let new = token(t, 1);
            let (k, v) = cache.append(1, &new, &(&new * 2.0).unwrap()).unwrap();
            appended.push(new);
            let expected = Tensor::cat(&appended, 2).unwrap();
            assert_eq!(k.dims(), &[1, 2, t + 1, 3]);
            let diff = |a: &Tensor, b: &Tensor| {
                (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            assert_eq!(diff(&k, &expected), 0.0, "keys after {} tokens", t + 1);
            assert_eq!(
                diff(&v, &(&expected * 2.0).unwrap()),
                0.0,
                "values after {} tokens",
                t + 1
            );
        }
        assert!(cache.slots[0].is_none(), "the other slot is untouched");
        let err = cache.append(2, &token(0, 1), &token(0, 1)).unwrap_err();
        assert!(err.to_string().contains("slot 2 out of range"), "{err}");
    }

    /// An f16 cache holds its appends rounded to f16, across a growth, and hands them back in
    /// its own dtype: the same values as an f32 cache of the rounded inputs.
    #[test]
    fn an_f16_cache_keeps_its_appends_rounded() {
        let thirds = |start: usize, count: usize| {
            let values: Vec<f32> = (start..start + count * 6)
                .map(|v| v as f32 / 3.0 + 1000.0)
                .collect();
            Tensor::from_vec(values, (1, 2, count, 3), &Device::Cpu).unwrap()
        };
        let mut cache = SeqCache::new(1, DType::F16);
        let mut appended = vec![thirds(0, 3)];
        cache.append(0, &appended[0], &appended[0]).unwrap();
        for t in 3..MIN_CAPACITY + 3 {
            appended.push(thirds(t * 6, 1));
            let (k, v) = cache
                .append(0, appended.last().unwrap(), appended.last().unwrap())
                .unwrap();
            assert_eq!((k.dtype(), v.dtype()), (DType::F16, DType::F16));
            let rounded: Vec<f32> = Tensor::cat(&appended, 2)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(|x| half::f16::from_f32(x).to_f32())
                .collect();
            let held = |t: &Tensor| -> Vec<f32> {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            assert_eq!(held(&k), rounded, "keys after {} tokens", t + 1);
            assert_eq!(held(&v), rounded, "values after {} tokens", t + 1);
        }
    }

    /// A pass over `tokens`, one row per cache.
    fn two_rows<'c>(tokens: &[Vec<u32>], caches: &'c mut [SeqCache; 2]) -> ForwardBatch<'c> {
        let [a, b] = caches;
        let device = Device::Cpu;
        ForwardBatch::new(
            tokens,
            &[0, 0],
            vec![a, b],
            Logits::Last,
            &device,
            DType::F32,
        )
        .unwrap()
    }

    /// Keys and values written from the projection on the team hold the bits the tensor append
    /// writes from the rotated keys and the values: both caches' dtypes, both rotary layouts, a
    /// left-padded row, and a second pass that writes after what the first left.
    #[test]
    fn a_projected_append_writes_what_the_tensor_append_writes() {
        let (kv_heads, d) = (2, 4);
        // Per position: two query heads, then the key heads, then the value heads.
        let (keys_at, values_at) = (2 * d, 2 * d + kv_heads * d);
        let width = values_at + kv_heads * d;
        let mut seed = 7u32;
        let mut random = |shape: (usize, usize, usize)| {
            let values = (0..shape.0 * shape.1 * shape.2)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1 << 24) as f32 * 4.0 - 2.0
                })
                .collect();
            Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
        };
        for dtype in [DType::F32, DType::F16] {
            for layout in [RopeLayout::Halves, RopeLayout::Interleaved] {
                let columns = ProjectionColumns {
                    width,
                    keys_at,
                    values_at,
                    kv_heads,
                    head_dim: d,
                    layout,
                };
                let mut by_tensors = [SeqCache::new(2, dtype), SeqCache::new(2, dtype)];
                let mut projected = [SeqCache::new(2, dtype), SeqCache::new(2, dtype)];
                // A prompt of 5 tokens beside one of 3 (left-padded), then one token each.
                for tokens in [
                    vec![vec![1, 2, 3, 4, 5], vec![6, 7, 8]],
                    vec![vec![9], vec![10]],
                ] {
                    let s = tokens[0].len();
                    let proj = random((2, s, width));
                    let angles = random((2, s, d / 2));
                    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
                    let mut tensor_batch = two_rows(&tokens, &mut by_tensors);
                    let by_head = proj.reshape((2, s, width / d, d)).unwrap();
                    let heads = |first: usize| {
                        let view = by_head.narrow(2, first, kv_heads).unwrap();
                        view.transpose(1, 2).unwrap()
                    };
                    let keys = heads(keys_at / d)
                        .contiguous()
                        .unwrap()
                        .apply_op3(&cos, &sin, crate::fused::RopeOp { layout })
                        .unwrap();
                    for slot in 0..2 {
                        tensor_batch
                            .append(slot, &keys, &heads(values_at / d))
                            .unwrap();
                    }
                    tensor_batch.commit();
                    let mut projected_batch = two_rows(&tokens, &mut projected);
                    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for slot in 0..2 {
                        let inputs = (&values(&proj)[..], &values(&cos)[..], &values(&sin)[..]);
                        assert!(
                            projected_batch
                                .append_projected(slot, inputs, columns)
                                .unwrap()
                        );
                    }
                    projected_batch.commit();
                }
                // The whole buffers, past the cached positions too: both paths size them alike,
                // and a first append that made its buffers from the rows must have written
                // every value of them.
                let held = |cache: &SeqCache, slot: usize| -> Vec<u32> {
                    let buffers = cache.slots[slot].as_ref().unwrap();
                    [&buffers.keys, &buffers.values]
                        .into_iter()
                        .flat_map(|t| {
                            let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                            t.to_vec1::<f32>().unwrap()
                        })
                        .map(f32::to_bits)
                        .collect()
                };
                for (row, (a, b)) in by_tensors.iter().zip(&projected).enumerate() {
                    for slot in 0..2 {
                        assert_eq!(
                            held(a, slot),
                            held(b, slot),
                            "{dtype:?}, {layout:?}, row {row}, slot {slot}"
                        );
                    }
                }
            }
        }
    }

    /// A prompt's pass leaves room for as many tokens again: the decode steps after it write in
    /// place, and the buffer doubles only once they have filled that room.
    #[test]
    fn a_prompts_pass_leaves_room_for_the_steps_after_it() {
        let prompt = 3 * MIN_CAPACITY;
        let zeros = |n: usize| Tensor::zeros((1, 2, n, 3), DType::F32, &Device::Cpu).unwrap();
        let capacity = |cache: &SeqCache| {
            let slot = cache.slots[0].as_ref().expect("slot 0 holds the prompt");
            (slot.keys.dim(2).unwrap(), slot.values.dim(2).unwrap())
        };
        let mut cache = SeqCache::new(1, DType::F32);
        cache.append(0, &zeros(prompt), &zeros(prompt)).unwrap();
        assert_eq!(capacity(&cache), (2 * prompt, 2 * prompt));
        for _ in 0..prompt {
            cache.append(0, &zeros(1), &zeros(1)).unwrap();
        }
        assert_eq!(capacity(&cache), (2 * prompt, 2 * prompt));
        cache.append(0, &zeros(1), &zeros(1)).unwrap();
        assert_eq!(capacity(&cache), (4 * prompt, 4 * prompt));
    }

    /// A cache told how many decode steps follow makes its first buffers the prompt and those
    /// steps (where that is less than as many again), and still grows past them.
    #[test]
    fn a_decode_room_sizes_the_first_buffers() {
        let prompt = 3 * MIN_CAPACITY;
        let zeros = |n: usize| Tensor::zeros((1, 2, n, 3), DType::F32, &Device::Cpu).unwrap();
        let capacity = |cache: &SeqCache| cache.slots[0].as_ref().unwrap().keys.dim(2).unwrap();
        // The room comes from a request's `max_tokens`: a huge one must not size the buffers.
        for (room, first) in [
            (5, prompt + 5),
            (0, prompt),
            (10 * prompt, 2 * prompt),
            (usize::MAX, 2 * prompt),
        ] {
            let mut cache = SeqCache::new(1, DType::F32).with_decode_room(room);
            cache.append(0, &zeros(prompt), &zeros(prompt)).unwrap();
            assert_eq!(capacity(&cache), first, "room {room}");
            for _ in 0..first - prompt + 1 {
                cache.append(0, &zeros(1), &zeros(1)).unwrap();
            }
            assert_eq!(capacity(&cache), 2 * first, "room {room}, grown");
            assert_eq!(
                cache
                    .append(0, &zeros(1), &zeros(1))
                    .unwrap()
                    .0
                    .dim(2)
                    .unwrap(),
                first + 2
            );
        }
        let mut short = SeqCache::new(1, DType::F32).with_decode_room(1);
        short.append(0, &zeros(2), &zeros(2)).unwrap();
        assert_eq!(capacity(&short), MIN_CAPACITY);
    }

    /// A pass that fails before its commit leaves the positions it appended behind; the next
    /// pass over the cache starts from what was committed, so a retried prompt or step reads
    /// no stale keys, and every slot holds the same tokens.
    #[test]
    fn a_failed_pass_leaves_nothing_for_the_next() {
        let kv = |n: usize, value: f32| Tensor::full(value, (1, 2, n, 3), &Device::Cpu).unwrap();
        let mut cache = SeqCache::new(2, DType::F32);
        let mut pass = |tokens: Vec<u32>, slots: &[usize], commit: bool| -> Vec<usize> {
            let n = tokens.len();
            let mut batch = ForwardBatch::new(
                &[tokens],
                &[0],
                vec![&mut cache],
                Logits::Last,
                &Device::Cpu,
                DType::F32,
            )
            .unwrap();
            let lengths = slots
                .iter()
                .map(|&slot| {
                    let appended = batch.append(slot, &kv(n, 1.0), &kv(n, 1.0)).unwrap();
                    appended[0].0.dim(2).unwrap()
                })
                .collect();
            if commit {
                batch.commit();
            }
            lengths
        };
        // A prompt's pass that fails after its first slot, then its retry.
        assert_eq!(pass(vec![1, 2, 3], &[0], false), [3]);
        assert_eq!(pass(vec![1, 2, 3], &[0, 1], true), [3, 3]);
        // A decode step that fails after its first slot, then its retry.
        assert_eq!(pass(vec![4], &[0], false), [4]);
        assert_eq!(pass(vec![4], &[0, 1], true), [4, 4]);
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn causal_prefill_with_left_padding() {
        let rows = [
            RowLayout {
                padding: 0,
                past: 0,
                block: 0,
            },
            RowLayout {
                padding: 2,
                past: 0,
                block: 0,
            },
        ];
        let mask = build_mask(&rows, 3, 3, &Device::Cpu, DType::F32).unwrap();
        // Row 0 is plainly causal.
        assert!(visible(&mask, 0, 2, 0) && visible(&mask, 0, 1, 1) && !visible(&mask, 0, 0, 1));
        // Row 1 has one real token at index 2; it sees only itself.
        assert!(visible(&mask, 1, 2, 2) && !visible(&mask, 1, 2, 1) && !visible(&mask, 1, 2, 0));
    }

    #[test]
    fn prefix_block_is_bidirectional_and_the_rest_causal() {
        let rows = [RowLayout {
            padding: 0,
            past: 0,
            block: 2,
        }];
        let mask = build_mask(&rows, 4, 4, &Device::Cpu, DType::F32).unwrap();
        assert!(
            visible(&mask, 0, 0, 1),
            "prompt token sees a later prompt token"
        );
        assert!(
            !visible(&mask, 0, 0, 2),
            "prompt token does not see the continuation"
        );
        assert!(visible(&mask, 0, 3, 0) && visible(&mask, 0, 3, 3) && !visible(&mask, 0, 2, 3));
    }

    #[test]
    fn decode_rows_with_different_histories() {
        // Row 0 has 4 cached tokens, row 1 has 2; each adds one.
        let rows = [
            RowLayout {
                padding: 0,
                past: 4,
                block: 0,
            },
            RowLayout {
                padding: 0,
                past: 2,
                block: 0,
            },
        ];
        let mask = build_mask(&rows, 1, 5, &Device::Cpu, DType::F32).unwrap();
        assert!((0..5).all(|t| visible(&mask, 0, 0, t)));
        assert!(!visible(&mask, 1, 0, 0) && !visible(&mask, 1, 0, 1));
        assert!((2..5).all(|t| visible(&mask, 1, 0, t)));
    }

    #[test]
    fn single_decode_row_needs_no_mask() {
        let rows = [RowLayout {
            padding: 0,
            past: 7,
            block: 0,
        }];
        assert!(
            build_mask(&rows, 1, 8, &Device::Cpu, DType::F32)
                .unwrap()
                .is_none()
        );
    }
}
