//! Several sequences' KV caches of one layer in one buffer, for batch decode steps: one write
//! for every row's new tokens, and on CUDA one attention call (`mlx::fast::rows_attention`),
//! where caches of their own cost each row a write, two reads and an attention call per layer
//! (per query, for a speculative row's verify on the lone-row path). On a GPU a batch step is
//! bound by the host's work per graph node (docs/gpu-rows.md), so those per-row nodes are what
//! a wide batch pays for.
//!
//! mlx-lm's BatchKVCache (models/cache.py) pads its rows on the left so that one mask serves
//! them all; that moves a row's keys away from the positions of its lone cache, and with them
//! the order its attention reads them in. Here every row starts at position 0 of its own slot
//! and keeps its own extent, so its keys sit where its lone cache keeps them, and a speculative
//! row's rejected drafts are taken back by setting its extent back, as its lone cache trims.

use mlx::{ops, Array, Dtype};

use super::kv::seq;
use super::{buffer_positions, off_cudnn_decode, KvCache, LayerCache, STEP};
use crate::error::contract;
use crate::Result;

/// The keys from which a lone one-token step in half precision on CUDA leaves MLX's vector
/// kernel for cuDNN's decode kernel (mlx/backend/cuda/scaled_dot_product_attention.cpp,
/// `use_cudnn_for_decoding`: float16 or bfloat16 keys sliced out of a KV cache's own buffer of
/// a multiple of 256 positions, at least 256 of them). That kernel reads the row's own buffer,
/// its capacity included, which a row of a shared buffer has not: no call over a shared buffer
/// gives its bits.
const CUDNN_DECODE_KEYS: usize = 256;

/// Slots are added this many at a time: a new slot copies the buffer.
const SLOT_STEP: i32 = 8;

/// A shared buffer may hold at most this many times the positions its rows' own caches would:
/// every slot is as long as the longest row, and one long row beside short ones would multiply
/// the memory of all of them.
const MAX_PADDING: usize = 2;

#[derive(Clone)]
pub struct BatchKvCache {
    /// (slots, H, capacity, D) buffers; a slot's first `extents[slot]` positions are its row's.
    keys: Array,
    values: Array,
    extents: Vec<usize>,
    /// The slots of the rows, in the order of the rows a step carries.
    active: Vec<usize>,
    /// The next step's layout, built once for every layer ([`plan_step`]).
    planned: Option<StepLayout>,
}

/// The positions a lone KV cache of `len` tokens allocates for its next one.
fn own_positions(len: usize) -> usize {
    round_up(len as i32 + 1, STEP) as usize
}

/// `n` rounded up to a multiple of `step`.
fn round_up(n: i32, step: i32) -> i32 {
    (n + step - 1) / step * step
}

impl BatchKvCache {
    /// A cache holding `rows` (each a lone KV cache that has seen at least one token), in order.
    pub fn gather(rows: &[&KvCache]) -> Result<BatchKvCache> {
        let first = rows
            .first()
            .and_then(|r| r.kv.as_ref())
            .ok_or_else(|| contract("a batch cache gathers at least one filled KV cache"))?;
        let (k, v) = first;
        let longest = rows.iter().map(|r| r.offset).max().unwrap_or(0) as i32;
        let slots = round_up(rows.len() as i32, SLOT_STEP);
        let capacity = round_up(longest + 1, STEP);
        let mut cache = BatchKvCache {
            keys: Array::zeros(&[slots, k.dim(1), capacity, k.dim(3)], k.dtype())?,
            values: Array::zeros(&[slots, v.dim(1), capacity, v.dim(3)], v.dtype())?,
            extents: vec![0; slots as usize],
            active: Vec::new(),
            planned: None,
        };
        for row in rows {
            cache.join(row)?;
        }
        Ok(cache)
    }

    /// Adds `row` as the last row, in a free slot (the buffer grows when there is none).
    pub fn join(&mut self, row: &KvCache) -> Result<()> {
        let Some((k, v)) = &row.kv else {
            return Err(contract("a batch cache row joins with an empty KV cache"));
        };
        let slot = match (0..self.extents.len()).find(|s| !self.active.contains(s)) {
            Some(slot) => slot,
            None => {
                self.add_slots(SLOT_STEP)?;
                self.extents.len() - SLOT_STEP as usize
            }
        };
        let len = row.offset as i32;
        if len + 1 > self.capacity() {
            self.add_capacity(round_up(len + 1, STEP) - self.capacity())?;
        }
        let at = |buffer: &Array, rows: &Array| -> mlx::Result<Array> {
            let s = buffer.shape();
            buffer.slice_update(
                &seq(rows, 0, len)?,
                &[slot as i32, 0, 0, 0],
                &[slot as i32 + 1, s[1], len, s[3]],
                &[1, 1, 1, 1],
            )
        };
        self.keys = at(&self.keys, k)?;
        self.values = at(&self.values, v)?;
        self.extents[slot] = row.offset;
        self.active.push(slot);
        Ok(())
    }

    /// Takes row `row` out (the later rows move up one) as the lone KV cache it would be,
    /// copied out of the shared buffer; the caller evaluates the copy before the buffer is
    /// written again, so that the buffer stays its own (one wait for every layer's copy).
    pub fn leave(&mut self, row: usize) -> Result<KvCache> {
        let slot = self.active.remove(row);
        let len = self.extents[slot] as i32;
        let pad = buffer_positions(round_up(len + 1, STEP), self.keys.dtype()) - len;
        let copy = |buffer: &Array| -> Result<Array> {
            let own = buffer.slice_axis(0, slot as i32, slot as i32 + 1)?;
            let own = seq(&own, 0, len)?;
            let s = own.shape();
            let zeros = Array::zeros(&[1, s[1], pad, s[3]], own.dtype())?;
            Ok(ops::concatenate(&[&own, &zeros], 2)?)
        };
        let (k, v) = (copy(&self.keys)?, copy(&self.values)?);
        Ok(KvCache {
            kv: Some((k, v)),
            offset: len as usize,
            round_start: None,
        })
    }

    /// Takes row `row` out (the later rows move up one) without a copy: its slot is free for
    /// the next row to join, which writes over it.
    pub fn drop_row(&mut self, row: usize) {
        self.active.remove(row);
    }

    /// Whether rows of `dtype` keys whose steps read up to `keys` of them can share a buffer and
    /// still each attend with its lone step's bits: everywhere but on CUDA in half precision
    /// from 256 keys on (`CUDNN_DECODE_KEYS`) where lone caches keep mlx-lm's buffers (golden
    /// replay; verity's own keep off cuDNN's decode kernel, [`off_cudnn_decode`]).
    pub fn keeps_lone_attention(dtype: Dtype, keys: usize) -> bool {
        let half = matches!(dtype, Dtype::Float16 | Dtype::Bfloat16);
        !(mlx::default_is_cuda() && half && keys >= CUDNN_DECODE_KEYS) || off_cudnn_decode(dtype)
    }

    /// The element type of the keys.
    pub fn dtype(&self) -> Dtype {
        self.keys.dtype()
    }

    /// Whether rows of `lens` tokens fit one buffer without padding it past [`MAX_PADDING`]
    /// times the positions their own caches would hold.
    pub fn fits(lens: &[usize]) -> bool {
        let longest = lens.iter().copied().max().unwrap_or(0);
        lens.len() * own_positions(longest)
            <= MAX_PADDING * lens.iter().map(|&l| own_positions(l)).sum::<usize>()
    }

    /// Whether this buffer outgrew its rows (a long row left), so that gathering them afresh
    /// would pad less.
    pub fn outgrown(&self) -> bool {
        let held: usize = self.offsets().into_iter().map(own_positions).sum();
        self.rows() * self.capacity() as usize > MAX_PADDING * held
    }

    /// The rows, in order.
    pub fn rows(&self) -> usize {
        self.active.len()
    }

    /// Each row's tokens so far (the RoPE offset of its next token).
    pub fn offsets(&self) -> Vec<usize> {
        self.active.iter().map(|&s| self.extents[s]).collect()
    }

    fn capacity(&self) -> i32 {
        self.keys.dim(2)
    }

    /// `buffer` with `more` zeros appended along `axis`.
    fn padded(buffer: &Array, axis: i32, more: i32) -> Result<Array> {
        let mut shape = buffer.shape();
        shape[axis as usize] = more;
        let zeros = Array::zeros(&shape, buffer.dtype())?;
        Ok(ops::concatenate(&[buffer, &zeros], axis)?)
    }

    /// Room for `more` rows (copies the buffers).
    fn add_slots(&mut self, more: i32) -> Result<()> {
        self.keys = Self::padded(&self.keys, 0, more)?;
        self.values = Self::padded(&self.values, 0, more)?;
        self.extents.resize(self.extents.len() + more as usize, 0);
        Ok(())
    }

    /// Room for `more` positions per row (copies the buffers).
    fn add_capacity(&mut self, more: i32) -> Result<()> {
        self.keys = Self::padded(&self.keys, 2, more)?;
        self.values = Self::padded(&self.values, 2, more)?;
        Ok(())
    }

    /// Where a step whose rows take `lens` tokens each (row r's `lens[r]` tokens, from its
    /// offset on; a row may take none) puts them and what their queries read. Every layer of a
    /// batch's caches holds the same rows, so the batch builds it once per step
    /// ([`plan_step`]).
    pub fn layout(&self, lens: &[usize]) -> Result<StepLayout> {
        if lens.len() != self.rows() || lens.iter().all(|&n| n == 0) {
            return Err(contract(format!(
                "a batch cache of {} rows given row lengths {lens:?}",
                self.rows()
            )));
        }
        let offsets = self.offsets();
        let (mut positions, mut slots, mut query_extents) = (Vec::new(), Vec::new(), Vec::new());
        for ((&slot, &o), &n) in self.active.iter().zip(&offsets).zip(lens) {
            positions.extend((o..o + n).map(|p| p as i32));
            slots.extend(std::iter::repeat_n(slot as i32, n));
            query_extents.extend(o + 1..=o + n);
        }
        let int32 = |v: &[i32]| Array::from_slice(v, &[v.len() as i32]);
        let extents: Vec<i32> = query_extents.iter().map(|&e| e as i32).collect();
        Ok(StepLayout {
            lens: lens.to_vec(),
            offsets,
            positions: int32(&positions)?,
            slots: int32(&slots)?,
            extents: int32(&extents)?,
            query_extents,
        })
    }

    /// The layout of this step's `lens`: the one [`plan_step`] left, else built now.
    pub fn step_layout(&mut self, lens: &[usize]) -> Result<StepLayout> {
        match self.planned.take() {
            Some(planned) if planned.lens == lens && planned.offsets == self.offsets() => {
                Ok(planned)
            }
            _ => self.layout(lens),
        }
    }

    /// Writes the rows' new keys and values (T, H, 1, D), row r's `lens[r]` tokens in turn,
    /// where `layout` says, in one scatter per buffer, and returns the buffers with what each
    /// token's query reads: its row's slot and the keys up to its own (as a one-token step at
    /// its position reads them).
    pub fn append(&mut self, keys: &Array, values: &Array, layout: &StepLayout) -> Result<RowsKv> {
        if layout.offsets != self.offsets() {
            return Err(contract(
                "a step layout built for other rows of a batch cache",
            ));
        }
        let longest = layout.offsets.iter().zip(&layout.lens).map(|(o, n)| o + n);
        let needed = longest.max().unwrap_or(0) as i32;
        if needed > self.capacity() {
            self.add_capacity(round_up(needed - self.capacity(), STEP))?;
        }
        let t = layout.query_extents.len() as i32;
        let write = |buffer: &Array, new: &Array| -> Result<Array> {
            let s = new.shape();
            let updates = new.reshape(&[t, 1, s[1], 1, s[3]])?;
            Ok(ops::scatter(
                buffer,
                &[&layout.slots, &layout.positions],
                &updates,
                &[0, 2],
            )?)
        };
        self.keys = write(&self.keys, keys)?;
        self.values = write(&self.values, values)?;
        for (&s, &n) in self.active.iter().zip(&layout.lens) {
            self.extents[s] += n;
        }
        Ok(RowsKv {
            keys: self.keys.clone(),
            values: self.values.clone(),
            slots: layout.slots.clone(),
            extents: layout.extents.clone(),
            query_extents: layout.query_extents.clone(),
            slot_of: self.active.clone(),
            row_extents: self.offsets(),
        })
    }

    /// Takes back row `row`'s last `n` tokens (a speculative round's rejected drafts), as its
    /// lone cache trims them: later writes overwrite them.
    pub fn trim(&mut self, row: usize, n: usize) -> Result<()> {
        let slot = *self
            .active
            .get(row)
            .ok_or_else(|| contract(format!("no row {row} in a batch cache")))?;
        if n > self.extents[slot] {
            return Err(contract(format!(
                "cannot take back {n} of row {row}'s {} tokens",
                self.extents[slot]
            )));
        }
        self.extents[slot] -= n;
        Ok(())
    }

    pub fn state(&self) -> Vec<&Array> {
        vec![&self.keys, &self.values]
    }
}

/// Where a batch step's tokens go and what their queries read ([`BatchKvCache::layout`]).
#[derive(Clone)]
pub struct StepLayout {
    lens: Vec<usize>,
    /// The rows' offsets before the step.
    offsets: Vec<usize>,
    /// Each token's position: its RoPE offset and where it is written.
    pub positions: Array,
    /// Each token's slot, and the keys its query reads (its row's up to its own).
    slots: Array,
    extents: Array,
    query_extents: Vec<usize>,
}

/// The first batch cache of `caches` (a hybrid model's first attention layer's).
pub fn first_batch(caches: &[LayerCache]) -> Option<&BatchKvCache> {
    caches.iter().find_map(|c| match c {
        LayerCache::Batch(b) => Some(b),
        _ => None,
    })
}

/// Builds the layout of a step whose rows take `lens` tokens once and leaves it with every
/// layer's batch cache of `caches` (each would build the same arrays again). Nothing happens
/// for caches other than batch caches.
pub fn plan_step(caches: &mut [LayerCache], lens: &[usize]) -> Result<()> {
    let Some(first) = first_batch(caches) else {
        return Ok(());
    };
    let layout = first.layout(lens)?;
    for cache in caches {
        if let LayerCache::Batch(b) = cache {
            b.planned = Some(layout.clone());
        }
    }
    Ok(())
}

/// What a batch step's attention reads after [`BatchKvCache::append`]: per query (every new
/// token of every row, in order) and per row.
pub struct RowsKv {
    /// The shared (slots, H, capacity, D) buffers.
    pub keys: Array,
    pub values: Array,
    /// Each query's slot and the keys it reads (its row's up to its own), as int32 arrays for a
    /// kernel and as numbers.
    pub slots: Array,
    pub extents: Array,
    pub query_extents: Vec<usize>,
    /// Each row's slot and its extent after the write.
    pub slot_of: Vec<usize>,
    pub row_extents: Vec<usize>,
}

impl RowsKv {
    /// Row `r`'s keys and values alone, (1, H, extent, D): what its lone cache returns.
    pub fn row(&self, r: usize) -> Result<(Array, Array)> {
        let (slot, len) = (self.slot_of[r] as i32, self.row_extents[r] as i32);
        let own = |buffer: &Array| -> mlx::Result<Array> {
            seq(&buffer.slice_axis(0, slot, slot + 1)?, 0, len)
        };
        Ok((own(&self.keys)?, own(&self.values)?))
    }
}
