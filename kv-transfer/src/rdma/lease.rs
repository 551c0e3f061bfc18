//! The RDMA payload of one lease, as the receiver's state machine holds it
//! ([`crate::payload::LeasePayload`]): the payload lands in the blocks by itself, one-sided; the
//! lease's one control stream carries a [`Landed`] notice per (layer, prefill chunk) write group,
//! each collected here in order and checked against the pool once the link says every group
//! landed. [`super::handoff`]'s `RecvPath` gives one when it binds a lease to a link.
//!
//! Sans-IO like the state machine around it: no link, no clock; the link's side (tags,
//! completions, quarantine) is [`super::handoff`]'s.
//!
//! Invariants:
//! - notices of a layer arrive in token order without a gap and numbered `0, 1, ...` (so a
//!   duplicate notice is a gap: its number or its tokens were already seen); none after
//!   `Complete`;
//! - at `Complete` every layer holds every token (in any number of chunks: a preempted prefill
//!   may have chunked its layers differently), and the link is told each layer's chunk count;
//! - the lease is ready only once the link reported every group landed and every notice's
//!   checksum matched what is in the pool.

use bytes::Bytes;
use cleave_protocol::LeaseId;

use crate::error::{KvTransferError, Result};
use crate::frame::{run_bytes, ChunkHeader, Control, Landed};
use crate::payload::{Expect, KvWrite, LandedCheck, LeaseCx, LeasePayload, LinkTag};

/// One lease's payload over an RDMA link.
#[derive(Debug, Clone)]
pub struct RdmaLease {
    /// The link and the lease's tag on it.
    at: LinkTag,
    notices: Vec<Landed>,
    /// Next expected token per layer.
    next: Vec<u32>,
    /// Notices so far per layer (the next expected chunk index).
    chunks: Vec<u32>,
    /// The sender sent `Complete`: no notice may follow.
    completed: bool,
    /// The link reported every group landed and every checksum matched.
    verified: bool,
}

impl RdmaLease {
    /// The payload of a lease the link `at.link` took under tag `at.tag`.
    pub fn new(at: LinkTag, num_layers: u32) -> Self {
        let layers = num_layers as usize;
        Self {
            at,
            notices: Vec::new(),
            next: vec![0; layers],
            chunks: vec![0; layers],
            completed: false,
            verified: false,
        }
    }
}

impl LeasePayload for RdmaLease {
    fn accept(&self, lease: LeaseId) -> Control {
        Control::Accept { lease_id: lease, rdma_tag: Some(self.at.tag) }
    }

    fn link(&self) -> Option<LinkTag> {
        Some(self.at)
    }

    fn chunk(&mut self, cx: &LeaseCx<'_>, _h: ChunkHeader, _k: Bytes, _v: Bytes) -> Result<Option<KvWrite>> {
        Err(KvTransferError::Protocol {
            reason: format!("a payload chunk for {}, whose payload travels over RDMA", cx.id),
        })
    }

    fn notice(&mut self, cx: &LeaseCx<'_>, n: Landed) -> Result<()> {
        let id = cx.id;
        let end = n.token_start as u64 + n.token_count as u64;
        if self.completed {
            return Err(KvTransferError::Protocol { reason: format!("a Landed notice for {id} after its Complete") });
        }
        if n.layer >= cx.layout.num_layers || n.token_count == 0 || end > cx.num_tokens as u64 {
            return Err(KvTransferError::ChunkOutOfBounds {
                lease: id,
                reason: format!("layer {} tokens {}..{end} of {}", n.layer, n.token_start, cx.num_tokens),
            });
        }
        let layer = n.layer as usize;
        if n.token_start != self.next[layer] {
            return Err(KvTransferError::ChunkGap {
                lease: id,
                layer: n.layer,
                expected: self.next[layer],
                got: n.token_start,
            });
        }
        if n.chunk != self.chunks[layer] {
            return Err(KvTransferError::Protocol {
                reason: format!(
                    "{id} layer {}: notice of chunk {}, chunk {} expected",
                    n.layer, n.chunk, self.chunks[layer]
                ),
            });
        }
        self.chunks[layer] += 1;
        self.next[layer] = end as u32;
        self.notices.push(n);
        Ok(())
    }

    /// Every layer must hold every token; then the link is told how many groups to expect.
    fn complete(&mut self, cx: &LeaseCx<'_>) -> Result<Option<Expect>> {
        self.completed = true;
        if let Some((layer, next)) = self.next.iter().enumerate().find(|(_, n)| **n != cx.num_tokens) {
            return Err(KvTransferError::ChunkGap {
                lease: cx.id,
                layer: layer as u32,
                expected: *next,
                got: cx.num_tokens,
            });
        }
        Ok(Some(Expect { at: self.at, chunks: self.chunks.clone() }))
    }

    fn landed(&mut self, cx: &LeaseCx<'_>, check: LandedCheck<'_>) -> Result<u64> {
        for n in &self.notices {
            let got = check(&cx.blocks[..], n)?;
            if got != n.crc32 {
                return Err(KvTransferError::ChecksumMismatch {
                    lease: cx.id,
                    layer: n.layer,
                    token_start: n.token_start,
                    token_count: n.token_count,
                    expected: n.crc32,
                    got,
                });
            }
        }
        self.verified = true;
        let tokens: u64 = self.notices.iter().map(|n| n.token_count as u64).sum();
        Ok(2 * tokens * run_bytes(cx.layout, 1) as u64)
    }

    fn ready(&self) -> bool {
        self.verified
    }
}
