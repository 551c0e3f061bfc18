//! The request machine, path by path: every test drives a [`Journey`] with explicit instants and
//! checks its actions. The harness checks the module's invariants on every batch (answer-asking
//! actions last, nothing after `Finish`, a deadline whenever the machine waits) and, when a test
//! ends, that every booking was returned exactly once and the client saw a well-formed stream.

use std::time::{Duration, Instant};

use cleave_protocol::control::{ControlMsg, HandoffDone, NodeRole, WireError, Work};
use cleave_protocol::{
    FinishReason, HandoffTicket, KvDtype, KvLayout, LeaseId, RequestId, SamplingParams, StopConditions, TokenEvent,
    TransportKind,
};

use super::*;
use crate::cluster::registry::{Assignment, LocalReason, NoRoute, NodeRef, Plan, Wait};
use crate::cluster::Observation;
use crate::dispatch::DispatchEvent;

const SILENCE: Duration = Duration::from_secs(120);
const PROMPT: [u32; 4] = [11, 12, 13, 14];
const ID: RequestId = RequestId(42);

fn node(id: u64, name: &str, role: NodeRole) -> NodeRef {
    NodeRef { id, name: name.into(), role, rpc_addr: ([127, 0, 0, 1], 7000 + id as u16).into() }
}

fn p0() -> NodeRef {
    node(1, "p0", NodeRole::Prefill)
}

fn d0() -> NodeRef {
    node(2, "d0", NodeRole::Decode)
}

fn d1() -> NodeRef {
    node(3, "d1", NodeRole::Decode)
}

fn limits() -> Limits {
    Limits { max_migrations: 2, max_prefill_retries: 2, node_silence_timeout: SILENCE }
}

fn tok(t: u32) -> TokenEvent {
    TokenEvent {
        request_id: RequestId(0),
        token_id: Some(t),
        text: String::new(),
        logprobs: None,
        finish_reason: None,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        error: None,
    }
}

fn fin(t: u32, reason: FinishReason) -> TokenEvent {
    TokenEvent { finish_reason: Some(reason), ..tok(t) }
}

fn node_err(message: &str) -> TokenEvent {
    TokenEvent::failed(RequestId(0), 0, 0, message.into())
}

fn ticket() -> HandoffTicket {
    HandoffTicket {
        version: 1,
        request_id: ID,
        lease_id: LeaseId(9),
        receiver_addr: ([127, 0, 0, 1], 9000).into(),
        transport: TransportKind::Quic,
        layout: KvLayout {
            model_fingerprint: 1,
            dtype: KvDtype::F32,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 16,
            block_size: 4,
        },
        block_ids: vec![1, 2],
        num_tokens: 4,
        lease_ttl: Duration::from_secs(5),
        receiver_name: None,
        cached_tokens: 0,
    }
}

fn dec(ev: TokenEvent) -> Event {
    Event::Message { side: Side::Decode, msg: ControlMsg::Token(ev) }
}

fn pre(ev: TokenEvent) -> Event {
    Event::Message { side: Side::Prefill, msg: ControlMsg::Token(ev) }
}

fn ticket_msg() -> Event {
    Event::Message { side: Side::Decode, msg: ControlMsg::Ticket(ticket()) }
}

fn handoff_done() -> Event {
    let report = HandoffDone { request_id: ID, transfer_bytes: 2048, ..Default::default() };
    Event::Message { side: Side::Prefill, msg: ControlMsg::HandoffDone(report) }
}

fn no_route(reason: &str, wait: Option<Wait>) -> Event {
    Event::Planned(Err(NoRoute { reason: reason.into(), wait, shed: false }))
}

/// One line per action, for comparing batches.
fn kinds(out: &[Action]) -> Vec<String> {
    out.iter()
        .map(|a| match a {
            Action::Plan(_) => "Plan".into(),
            Action::Tell(DispatchEvent::Routed(r)) => format!("Routed({})", r.path),
            Action::Tell(DispatchEvent::Refused { .. }) => "Refused".into(),
            Action::Tell(DispatchEvent::Token(ev)) => format!("Final({:?})", ev.finish_reason.unwrap()),
            Action::Record(m) => format!("Record({})", format!("{m:?}").split([' ', '{']).next().unwrap()),
            Action::Open(s) => if s.prefill.is_some() { "Open(remote)" } else { "Open(local)" }.into(),
            Action::ForwardTicket(_) => "ForwardTicket".into(),
            Action::Cancel(side) => format!("Cancel({side})"),
            Action::Emit(ev) => format!("Emit({})", ev.token_id.map_or("-".into(), |t| t.to_string())),
            Action::Handoff { .. } => "Handoff".into(),
            Action::ReportLater { .. } => "ReportLater".into(),
            Action::ReleasePrefill(_) => "ReleasePrefill".into(),
            Action::CloseStreams => "CloseStreams".into(),
            Action::Release(_) => "Release".into(),
            Action::Finish => "Finish".into(),
        })
        .collect()
}

fn streams(a: &Action) -> &Streams {
    match a {
        Action::Open(s) => s,
        _ => panic!("{a:?} opens nothing"),
    }
}

fn the_query(out: &[Action]) -> &RouteQuery {
    match out.last() {
        Some(Action::Plan(q)) => q,
        _ => panic!("no Plan last in {:?}", kinds(out)),
    }
}

/// A request driven by hand.
struct H {
    m: Journey,
    now: Instant,
    /// Bookings handed in with plans, in order.
    booked: Vec<Assignment>,
    /// Bookings (or prefill parts) handed back.
    returned: Vec<Assignment>,
    /// Everything sent to the client.
    client: Vec<DispatchEvent>,
    finished: bool,
    /// An answer-asking action is out.
    awaiting: bool,
}

impl H {
    fn new(max_tokens: u32) -> Self {
        Self::with(limits(), max_tokens)
    }

    fn with(limits: Limits, max_tokens: u32) -> Self {
        let work = Work {
            id: ID,
            prompt: PROMPT.to_vec(),
            params: SamplingParams::default(),
            stop: StopConditions { max_tokens, ..Default::default() },
        };
        let now = Instant::now();
        let mut h = Self {
            m: Journey::new(work, limits, now),
            now,
            booked: Vec::new(),
            returned: Vec::new(),
            client: Vec::new(),
            finished: false,
            awaiting: false,
        };
        let out = h.m.start(now);
        h.check(&out);
        assert_eq!(kinds(&out), ["Plan"]);
        let q = the_query(&out);
        assert_eq!(
            (q.tokens.as_slice(), q.max_tokens, q.exclude.len(), q.force_local, q.waited),
            (&PROMPT[..], max_tokens as usize, 0, false, Duration::ZERO)
        );
        h
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    fn feed(&mut self, ev: Event) -> Vec<Action> {
        if matches!(ev, Event::Planned(_) | Event::Opened { .. } | Event::Delivered | Event::ClientGone) {
            assert!(self.awaiting, "answer {ev:?} to no question");
            self.awaiting = false;
        }
        let out = self.m.handle(self.now, ev);
        self.check(&out);
        out
    }

    /// The invariants every batch keeps.
    fn check(&mut self, out: &[Action]) {
        assert!(!self.finished || out.is_empty(), "actions after Finish: {:?}", kinds(out));
        for (i, a) in out.iter().enumerate() {
            let last = i + 1 == out.len();
            match a {
                Action::Plan(_) | Action::Open(_) | Action::Emit(_) => {
                    assert!(last, "{:?} must end its batch", kinds(out));
                    self.awaiting = true;
                    if let Action::Plan(_) = a {
                        self.assert_all_returned();
                    }
                }
                Action::Finish => {
                    assert!(last, "Finish must end its batch: {:?}", kinds(out));
                    self.finished = true;
                    self.assert_all_returned();
                }
                Action::Release(_) => {
                    assert!(i > 0 && matches!(out[i - 1], Action::CloseStreams), "Release after CloseStreams");
                }
                _ => {}
            }
            match a {
                Action::Emit(ev) => self.client.push(DispatchEvent::Token(ev.clone())),
                Action::Tell(ev) => self.client.push(ev.clone()),
                Action::Release(b) | Action::ReleasePrefill(b) => self.returned.push(b.clone()),
                _ => {}
            }
        }
        assert_eq!(self.finished, self.m.is_done());
        if !self.finished && !self.awaiting {
            assert!(self.m.deadline().is_some(), "the machine waits without a deadline after {:?}", kinds(out));
        }
    }

    /// Every booking handed in came back exactly once: its prefill part alone or with the rest,
    /// its decode part with the rest.
    fn assert_all_returned(&self) {
        for b in &self.booked {
            let prefill = self.returned.iter().filter(|r| b.prefill.is_some() && r.prefill == b.prefill).count();
            let decode = self.returned.iter().filter(|r| r.decode == b.decode).count();
            assert_eq!(
                (prefill, decode),
                (b.prefill.is_some() as usize, 1),
                "booking {b:?} returned as {:?}",
                self.returned
            );
        }
        assert_eq!(
            self.returned.iter().filter(|r| r.decode.is_some()).count(),
            self.booked.len(),
            "returned {:?} for {:?}",
            self.returned,
            self.booked
        );
    }

    fn plan(&mut self, plan: Plan) -> Vec<Action> {
        let n = self.booked.len() as u64 + 1;
        let booking = Assignment {
            prefill: matches!(plan, Plan::Remote { .. }).then_some((1, 100 + n)),
            decode: Some((2, 200 + n)),
            blocks: 4,
        };
        self.booked.push(booking.clone());
        self.feed(Event::Planned(Ok((plan, booking))))
    }

    /// A remote attempt on p0 and `decode`, its streams open.
    fn remote_on(&mut self, decode: NodeRef) {
        let out = self.plan(Plan::Remote { prefill: p0(), decode });
        assert_eq!(kinds(&out), ["Routed(remote)", "Record(RouteDecision)", "Open(remote)"]);
        let out = self.feed(Event::Opened { decode: Ok(()), prefill: Some(Ok(())) });
        assert!(out.is_empty(), "{:?}", kinds(&out));
        assert!(self.m.reading(Side::Decode) && self.m.reading(Side::Prefill));
    }

    fn remote(&mut self) {
        self.remote_on(d0());
    }

    /// A local attempt on `decode`, its stream open.
    fn local_on(&mut self, decode: NodeRef, reason: LocalReason) {
        let out = self.plan(Plan::Local { decode, reason });
        assert_eq!(kinds(&out)[2], "Open(local)");
        let out = self.feed(Event::Opened { decode: Ok(()), prefill: None });
        assert!(out.is_empty(), "{:?}", kinds(&out));
        assert!(self.m.reading(Side::Decode) && !self.m.reading(Side::Prefill));
    }

    /// Feeds `ev` and delivers the emit it makes.
    fn token(&mut self, ev: Event) -> Vec<Action> {
        let out = self.feed(ev);
        assert!(matches!(out.last(), Some(Action::Emit(_))), "no emit: {:?}", kinds(&out));
        self.feed(Event::Delivered)
    }

    /// Remote attempt, ticket forwarded, first token `7` from the prefill node delivered.
    fn first_token(&mut self) {
        self.remote();
        assert_eq!(kinds(&self.feed(ticket_msg())), ["Record(Reservation)", "ForwardTicket"]);
        assert!(self.token(pre(tok(7))).is_empty());
    }

    fn tokens(&self) -> Vec<u32> {
        self.events().iter().filter_map(|e| e.token_id).collect()
    }

    fn events(&self) -> Vec<&TokenEvent> {
        self.client
            .iter()
            .filter_map(|e| match e {
                DispatchEvent::Token(ev) => Some(ev),
                _ => None,
            })
            .collect()
    }

    fn final_event(&self) -> &TokenEvent {
        let ev = *self.events().last().expect("no event");
        assert!(ev.finish_reason.is_some(), "{ev:?} is not final");
        ev
    }

    /// What the client was told went wrong: the refusal's reason, or the final event's error.
    fn error(&self) -> String {
        if let Some(DispatchEvent::Refused { reason }) =
            self.client.iter().find(|e| matches!(e, DispatchEvent::Refused { .. }))
        {
            return reason.clone();
        }
        let ev = self.final_event();
        assert_eq!(ev.finish_reason, Some(FinishReason::Error));
        ev.error.clone().unwrap()
    }
}

impl Drop for H {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // The client's stream is well formed: Refused alone, or tokens with rising counts and
        // nothing after a final event.
        let refused = self.client.iter().filter(|e| matches!(e, DispatchEvent::Refused { .. })).count();
        if refused > 0 {
            assert_eq!(refused, 1);
            assert!(self.events().is_empty(), "refused after tokens: {:?}", self.client);
        }
        let events = self.events();
        for (i, ev) in events.iter().enumerate() {
            assert_eq!(ev.request_id, ID);
            assert_eq!(ev.prompt_tokens, PROMPT.len() as u32);
            if ev.finish_reason.is_some() {
                assert_eq!(i + 1, events.len(), "events after the final one: {events:?}");
            }
        }
        let counts: Vec<u32> = events.iter().filter(|e| e.token_id.is_some()).map(|e| e.completion_tokens).collect();
        assert_eq!(counts, (1..=counts.len() as u32).collect::<Vec<_>>(), "counts");
        if self.finished {
            self.assert_all_returned();
        }
    }
}

// ---- Paths that end well -----------------------------------------------------------------------

#[test]
fn remote_request_forwards_the_ticket_streams_and_ends_on_the_decode_nodes_last_token() {
    let mut h = H::new(3);
    let out = h.plan(Plan::Remote { prefill: p0(), decode: d0() });
    let Streams { decode: (dn, dm), prefill: Some((pn, pm)) } = streams(&out[2]) else { panic!() };
    assert_eq!((dn.name.as_str(), pn.name.as_str()), ("d0", "p0"));
    assert!(
        matches!(dm, ControlMsg::DecodeRequest(r) if !r.local_prefill && r.generated.is_empty() && r.work.prompt == PROMPT)
    );
    assert!(matches!(pm, ControlMsg::PrefillRequest(r) if r.ticket.is_none()));
    assert!(matches!(&out[0], Action::Tell(DispatchEvent::Routed(r)) if r.prefill_node.as_deref() == Some("p0")));
    h.advance(Duration::from_millis(3));
    assert!(h.feed(Event::Opened { decode: Ok(()), prefill: Some(Ok(())) }).is_empty());
    assert_eq!(h.m.deadline(), Some(h.now + SILENCE));

    h.advance(Duration::from_millis(10));
    let out = h.feed(ticket_msg());
    assert!(matches!(&out[..], [Action::Record(Metric::Reservation { waited, .. }), Action::ForwardTicket(t)]
        if *waited == Duration::from_millis(13) && *t == ticket()));

    h.advance(Duration::from_millis(20));
    let out = h.feed(pre(TokenEvent { cached_tokens: 2, ..tok(7) }));
    assert_eq!(kinds(&out), ["Emit(7)"]);
    assert!(h.feed(Event::Delivered).is_empty());

    h.advance(Duration::from_millis(5));
    let out = h.feed(dec(tok(8)));
    assert!(matches!(&out[..], [Action::Record(Metric::DecodeFirstStep { after, .. }), Action::Emit(_)]
        if *after == Duration::from_millis(5)));
    h.feed(Event::Delivered);

    let out = h.feed(handoff_done());
    assert!(matches!(&out[..], [Action::Handoff { dispatched, .. }, Action::ReleasePrefill(_)]
        if *dispatched == Duration::from_millis(3)));
    assert!(!h.m.reading(Side::Prefill));

    h.advance(Duration::from_millis(5));
    assert_eq!(kinds(&h.feed(dec(fin(9, FinishReason::Stop)))), ["Emit(9)"], "no second first-step metric");
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["CloseStreams", "Release", "Finish"]);
    assert_eq!(h.tokens(), [7, 8, 9]);
    assert!(h.events().iter().all(|e| e.cached_tokens == 2));
    assert_eq!(h.final_event().finish_reason, Some(FinishReason::Stop));
    // The last Release carries no prefill part: it went back with the handoff report.
    assert_eq!(h.returned.last().unwrap().prefill, None);

    let Some(Observation::Completion { ttft, tpot, output_tokens, ok, path, .. }) = h.m.completion(h.now, false) else {
        panic!()
    };
    assert_eq!(ttft, Duration::from_millis(33));
    assert_eq!(tpot, Some(Duration::from_millis(5)));
    assert_eq!((output_tokens, ok, path), (3, true, "remote"));
}

#[test]
fn an_output_that_ends_before_the_handoff_report_reads_it_later() {
    let mut h = H::new(2);
    h.first_token();
    assert_eq!(kinds(&h.feed(dec(fin(8, FinishReason::Length)))), ["Record(DecodeFirstStep)", "Emit(8)"]);
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["ReportLater", "CloseStreams", "Release", "Finish"]);
    assert!(h.returned.last().unwrap().prefill.is_some(), "the prefill part goes back with the rest");
}

#[test]
fn the_first_token_ending_the_request_cancels_the_decode_side() {
    let mut h = H::new(1);
    h.remote();
    h.feed(ticket_msg());
    assert_eq!(kinds(&h.feed(pre(fin(7, FinishReason::Length)))), ["Emit(7)"]);
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Cancel(decode)", "CloseStreams", "Release", "Finish"]);
    assert_eq!(h.tokens(), [7]);
}

#[test]
fn a_client_gone_at_the_first_token_sends_no_cancel() {
    let mut h = H::new(1);
    h.remote();
    h.feed(pre(fin(7, FinishReason::Length)));
    assert_eq!(kinds(&h.feed(Event::ClientGone)), ["CloseStreams", "Release", "Finish"]);
}

#[test]
fn decode_events_that_overtake_the_first_token_are_sent_after_it_in_order() {
    let mut h = H::new(10);
    h.remote();
    h.feed(ticket_msg());
    assert!(h.feed(dec(tok(8))).is_empty(), "held");
    assert!(h.feed(dec(tok(9))).is_empty(), "held");
    assert!(h.client.len() == 1, "only Routed so far");
    assert_eq!(kinds(&h.feed(pre(tok(7)))), ["Emit(7)"]);
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Emit(8)"]);
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Emit(9)"]);
    assert!(h.feed(Event::Delivered).is_empty(), "back to reading");
    // The first event after the flush is the decode node's first step.
    assert_eq!(kinds(&h.feed(dec(tok(10)))), ["Record(DecodeFirstStep)", "Emit(10)"]);
    h.feed(Event::Delivered);
    assert_eq!(h.tokens(), [7, 8, 9, 10]);
}

#[test]
fn an_overtaking_last_event_ends_the_request_in_the_flush() {
    let mut h = H::new(2);
    h.remote();
    h.feed(dec(fin(8, FinishReason::Length)));
    h.feed(pre(tok(7)));
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Emit(8)"]);
    // The prefill node's report follows its first token: still to come (CI once lost it here).
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["ReportLater", "CloseStreams", "Release", "Finish"]);
    assert_eq!(h.tokens(), [7, 8]);
}

#[test]
fn a_client_gone_in_the_flush_stops_it() {
    let mut h = H::new(10);
    h.remote();
    h.feed(dec(tok(8)));
    h.feed(dec(tok(9)));
    h.feed(pre(tok(7)));
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Emit(8)"]);
    assert_eq!(kinds(&h.feed(Event::ClientGone)), ["CloseStreams", "Release", "Finish"]);
    let Some(Observation::Completion { output_tokens, ok, .. }) = h.m.completion(h.now, true) else { panic!() };
    assert_eq!((output_tokens, ok), (2, true));
}

#[test]
fn a_client_gone_mid_stream_ends_the_attempt() {
    let mut h = H::new(10);
    h.first_token();
    h.feed(dec(tok(8)));
    assert_eq!(kinds(&h.feed(Event::ClientGone)), ["CloseStreams", "Release", "Finish"]);
}

#[test]
fn a_local_attempt_streams_from_the_decode_node_alone() {
    let mut h = H::new(3);
    let out = h.plan(Plan::Local { decode: d0(), reason: LocalReason::ShortPrompt });
    assert_eq!(kinds(&out), ["Routed(local)", "Record(RouteDecision)", "Open(local)"]);
    assert!(matches!(&out[1], Action::Record(Metric::RouteDecision { path: "local", reason: "short_prompt" })));
    assert!(matches!(&streams(&out[2]).decode.1, ControlMsg::DecodeRequest(r) if r.local_prefill));
    h.feed(Event::Opened { decode: Ok(()), prefill: None });
    assert!(h.feed(ticket_msg()).is_empty(), "a ticket means nothing on a local attempt");
    assert_eq!(kinds(&h.feed(dec(TokenEvent { cached_tokens: 3, ..tok(7) }))), ["Emit(7)"], "no buffering");
    h.feed(Event::Delivered);
    h.token(dec(tok(8)));
    assert_eq!(kinds(&h.token(dec(fin(9, FinishReason::Length)))), ["CloseStreams", "Release", "Finish"]);
    assert_eq!(h.tokens(), [7, 8, 9]);
    assert_eq!(h.final_event().cached_tokens, 3);
    let Some(Observation::Completion { path, .. }) = h.m.completion(h.now, false) else { panic!() };
    assert_eq!(path, "short_prompt");
}

// ---- The decode node fails ---------------------------------------------------------------------

#[test]
fn a_decode_node_dying_before_its_ticket_is_retried_elsewhere_at_once() {
    let mut h = H::new(3);
    h.remote();
    assert!(h.feed(Event::NodeDied(99)).is_empty(), "another node's death");
    let out = h.feed(Event::NodeDied(d0().id));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Plan"], "no backoff for a dead node");
    let q = the_query(&out);
    assert_eq!((q.exclude.as_slice(), q.force_local, q.tokens.as_slice()), (&[2][..], false, &PROMPT[..]));
    h.remote_on(d1());
    h.feed(ticket_msg());
    h.token(pre(tok(7)));
    h.token(dec(fin(8, FinishReason::Stop)));
    assert!(h.finished);
    assert_eq!(h.tokens(), [7, 8]);
}

#[test]
fn a_decode_node_dying_during_the_early_token_buffer_drops_the_buffer_and_retries() {
    let mut h = H::new(5);
    h.remote();
    h.feed(ticket_msg());
    h.feed(dec(tok(80)));
    h.feed(dec(tok(81)));
    assert_eq!(kinds(&h.feed(Event::NodeDied(d0().id))), ["CloseStreams", "Release", "Plan"]);
    h.remote_on(d1());
    h.token(pre(tok(7)));
    h.token(dec(tok(8)));
    assert_eq!(h.tokens(), [7, 8], "the dead node's held events never reach the client");
}

#[test]
fn a_decode_node_dying_after_every_token_was_sent_ends_with_length() {
    let mut h = H::new(3);
    h.first_token();
    h.token(dec(tok(8)));
    h.token(dec(tok(9)));
    let out = h.feed(Event::NodeDied(d0().id));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Final(Length)", "Finish"]);
    let ev = h.final_event();
    assert_eq!((ev.completion_tokens, ev.token_id, ev.error.as_ref()), (3, None, None));
}

#[test]
fn a_death_after_the_last_token_changes_nothing() {
    let mut h = H::new(2);
    h.first_token();
    h.token(dec(fin(8, FinishReason::Length)));
    assert!(h.finished);
    // The harness checks that nothing follows Finish.
    h.feed(Event::NodeDied(d0().id));
    h.feed(Event::Lost { side: Side::Decode, cause: AttemptError::StreamClosed });
    h.feed(Event::Cancelled);
}

#[test]
fn a_decode_error_before_the_first_token_retries_on_it_after_a_growing_backoff() {
    let mut h = H::new(3);
    h.remote();
    h.feed(ticket_msg());
    assert_eq!(kinds(&h.feed(dec(node_err("out of kv blocks")))), ["CloseStreams", "Release"]);
    assert_eq!(h.m.deadline(), Some(h.now + RETRY_BACKOFF));
    h.advance(RETRY_BACKOFF / 2);
    assert!(h.feed(Event::Timer).is_empty(), "too early");
    h.advance(RETRY_BACKOFF / 2);
    let out = h.feed(Event::Timer);
    assert!(the_query(&out).exclude.is_empty(), "a node that said so itself may serve the retry");

    h.remote();
    assert_eq!(kinds(&h.feed(dec(node_err("out of kv blocks")))), ["CloseStreams", "Release"]);
    assert_eq!(h.m.deadline(), Some(h.now + RETRY_BACKOFF * 2), "longer at each retry");
    h.advance(RETRY_BACKOFF * 2);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);

    h.remote();
    let out = h.feed(dec(node_err("out of kv blocks")));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Final(Error)", "Finish"]);
    assert_eq!(h.error(), "gave up after 3 attempts: decode node d0: out of kv blocks");
    let Some(Observation::Completion { ok, .. }) = h.m.completion(h.now, false) else { panic!() };
    assert!(!ok);
}

#[test]
fn a_decode_error_after_the_first_token_migrates_at_once() {
    let mut h = H::new(4);
    h.first_token();
    h.token(dec(tok(8)));
    let out = h.feed(dec(node_err("handoff failed")));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Plan"]);
    let q = the_query(&out);
    assert_eq!(q.tokens, [&PROMPT[..], &[7, 8]].concat(), "prompt plus every token sent");
    assert_eq!((q.max_tokens, q.force_local, q.exclude.is_empty()), (2, true, true));

    let out = h.plan(Plan::Local { decode: d0(), reason: LocalReason::Migration });
    assert_eq!(kinds(&out), ["Routed(migrated)", "Record(RouteDecision)", "Open(local)"]);
    assert!(
        matches!(&streams(&out[2]).decode.1, ControlMsg::DecodeRequest(r) if r.local_prefill && r.generated == [7, 8])
    );
    h.feed(Event::Opened { decode: Ok(()), prefill: None });
    h.token(dec(tok(9)));
    h.token(dec(fin(10, FinishReason::Length)));
    assert_eq!(h.tokens(), [7, 8, 9, 10]);
    let Some(Observation::Completion { path, output_tokens, .. }) = h.m.completion(h.now, false) else { panic!() };
    assert_eq!((path, output_tokens), ("migration", 4));
}

#[test]
fn a_decode_stream_lost_after_the_first_token_migrates_away_from_the_node() {
    let mut h = H::new(4);
    h.first_token();
    let cause = AttemptError::StreamBroken(WireError::Malformed("junk".into()));
    let out = h.feed(Event::Lost { side: Side::Decode, cause });
    assert_eq!(the_query(&out).exclude, [2]);
}

#[test]
fn the_migration_limit_ends_the_stream_with_an_error() {
    let mut h = H::new(50);
    h.first_token();
    for n in 0..2 {
        let out = h.feed(Event::NodeDied(d0().id));
        assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Plan"], "migration {n}");
        h.local_on(d0(), LocalReason::Migration);
        h.token(dec(tok(8 + n)));
    }
    let out = h.feed(Event::NodeDied(d0().id));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Final(Error)", "Finish"]);
    assert_eq!(h.error(), "gave up after 2 migrations: decode node d0: the node died");
    assert_eq!(h.final_event().completion_tokens, 3);
}

#[test]
fn a_silent_decode_node_after_the_first_token_migrates_and_activity_restarts_the_timer() {
    let mut h = H::new(10);
    h.first_token();
    h.advance(SILENCE - Duration::from_secs(20));
    h.token(dec(tok(8)));
    h.advance(Duration::from_secs(20));
    assert!(h.feed(Event::Timer).is_empty(), "the token restarted the timer");
    assert!(h.feed(Event::NodeDied(77)).is_empty());
    assert_eq!(h.m.deadline(), Some(h.now + SILENCE - Duration::from_secs(20)), "another node's death does not");
    h.advance(SILENCE - Duration::from_secs(20));
    let out = h.feed(Event::Timer);
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Plan"]);
    assert_eq!(the_query(&out).exclude, [2]);
    h.feed(no_route("no decode node", None));
    assert_eq!(
        h.error(),
        "decode node d0: the node sent nothing for 120 s; then no node can serve this request: no decode node"
    );
}

#[test]
fn a_failed_open_of_the_decode_stream_excludes_the_node_whatever_the_prefill_stream_did() {
    let mut h = H::new(3);
    h.plan(Plan::Remote { prefill: p0(), decode: d0() });
    let refused =
        AttemptError::Connect(cleave_net::NetError::Connect { addr: d0().rpc_addr, reason: "refused".into() });
    let out = h.feed(Event::Opened {
        decode: Err(refused),
        prefill: Some(Err(AttemptError::Send(WireError::Malformed("x".into())))),
    });
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Plan"]);
    assert_eq!(the_query(&out).exclude, [2]);
    h.remote_on(d1());
    h.feed(Event::Cancelled);
}

// ---- The prefill node fails --------------------------------------------------------------------

#[test]
fn a_prefill_error_after_the_ticket_retries_on_another_node() {
    let mut h = H::new(3);
    h.remote();
    h.feed(ticket_msg());
    let out = h.feed(pre(node_err("engine failed")));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    assert!(h.returned.last().unwrap().prefill.is_some(), "the whole booking goes back at once");
    let q = the_query(&out);
    assert_eq!((q.exclude.as_slice(), q.force_local), (&[1][..], false));
    assert_eq!(h.client.len(), 1, "invisible to the client (only Routed)");
}

#[test]
fn a_prefill_stream_lost_before_the_first_token_returns_its_part_first() {
    let mut h = H::new(3);
    h.remote();
    h.feed(ticket_msg());
    let out = h.feed(Event::Lost { side: Side::Prefill, cause: AttemptError::StreamClosed });
    assert_eq!(kinds(&out), ["ReleasePrefill", "CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    h.feed(no_route("none left", None));
    assert_eq!(
        h.error(),
        "prefill node p0: the node closed the stream; then no node can serve this request: none left"
    );
}

#[test]
fn a_prefill_node_dying_before_the_first_token_is_retried() {
    let mut h = H::new(3);
    h.remote();
    let out = h.feed(Event::NodeDied(p0().id));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    assert_eq!(the_query(&out).exclude, [1]);
}

#[test]
fn a_silent_attempt_before_the_first_token_blames_the_prefill_node() {
    let mut h = H::new(3);
    h.remote();
    h.feed(ticket_msg());
    h.advance(SILENCE);
    let out = h.feed(Event::Timer);
    assert_eq!(kinds(&out), ["ReleasePrefill", "CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    assert_eq!(the_query(&out).exclude, [1]);
}

#[test]
fn a_prefill_failure_after_the_first_token_only_returns_its_part() {
    let mut h = H::new(4);
    h.first_token();
    assert_eq!(kinds(&h.feed(pre(node_err("handoff failed")))), ["ReleasePrefill"]);
    assert!(!h.m.reading(Side::Prefill));
    assert!(h.feed(Event::NodeDied(p0().id)).is_empty(), "its death no longer matters");
    h.token(dec(tok(8)));
    h.token(dec(fin(9, FinishReason::Stop)));
    assert_eq!(h.tokens(), [7, 8, 9]);
    assert_eq!(h.returned.last().unwrap().prefill, None);
}

#[test]
fn a_prefill_node_dying_after_the_decode_node_had_the_kv_is_no_failure() {
    let mut h = H::new(4);
    h.first_token();
    h.token(dec(tok(8)));
    assert!(h.feed(Event::NodeDied(p0().id)).is_empty());
    assert!(h.m.reading(Side::Prefill), "its stream tells the rest");
    assert_eq!(
        kinds(&h.feed(Event::Lost { side: Side::Prefill, cause: AttemptError::StreamClosed })),
        ["ReleasePrefill"]
    );
    h.token(dec(tok(9)));
    assert_eq!(h.tokens(), [7, 8, 9]);
}

#[test]
fn a_prefill_node_dying_after_its_handoff_report_is_no_failure() {
    let mut h = H::new(4);
    h.first_token();
    h.feed(handoff_done());
    assert!(h.feed(Event::NodeDied(p0().id)).is_empty());
    h.token(dec(tok(8)));
    assert_eq!(h.tokens(), [7, 8]);
}

/// The prefill node died between its first token and the end of its handoff: the decode node
/// may never hear of it before its lease expires (a minute), so the stream migrates at once,
/// its stream lost first or not.
#[test]
fn a_prefill_node_dying_before_its_handoff_was_settled_migrates_the_stream() {
    for stream_lost_first in [false, true] {
        let mut h = H::new(4);
        h.first_token();
        if stream_lost_first {
            let lost = h.feed(Event::Lost { side: Side::Prefill, cause: AttemptError::StreamClosed });
            assert_eq!(kinds(&lost), ["ReleasePrefill"]);
        }
        assert!(h.feed(Event::NodeDied(99)).is_empty(), "another node's death");
        let out = h.feed(Event::NodeDied(p0().id));
        assert_eq!(
            kinds(&out),
            ["CloseStreams", "Release", "Record(Migration)", "Plan"],
            "lost first: {stream_lost_first}"
        );
        let q = the_query(&out);
        assert_eq!(q.tokens, [&PROMPT[..], &[7]].concat(), "prompt plus the first token");
        assert_eq!((q.max_tokens, q.force_local, &q.exclude[..]), (3, true, &[p0().id][..]));
        let out = h.plan(Plan::Local { decode: d0(), reason: LocalReason::Migration });
        assert_eq!(kinds(&out), ["Routed(migrated)", "Record(RouteDecision)", "Open(local)"]);
        h.feed(Event::Opened { decode: Ok(()), prefill: None });
        h.token(dec(tok(8)));
        h.token(dec(fin(9, FinishReason::Stop)));
        assert_eq!(h.tokens(), [7, 8, 9]);
    }
}

#[test]
fn a_prefill_stream_lost_after_the_first_token_leaves_the_decision_to_the_decode_node() {
    let mut h = H::new(4);
    h.first_token();
    let cause = AttemptError::StreamBroken(WireError::Io(std::io::ErrorKind::ConnectionReset.into()));
    assert_eq!(kinds(&h.feed(Event::Lost { side: Side::Prefill, cause })), ["ReleasePrefill"]);
    assert!(h.m.reading(Side::Decode) && !h.m.reading(Side::Prefill));
    // The decode node learns of the broken handoff from its lease: the stream migrates.
    let out = h.feed(dec(node_err("handoff of lease 9 failed")));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(Migration)", "Plan"]);
}

#[test]
fn a_second_prefill_token_and_unknown_messages_are_ignored() {
    let mut h = H::new(4);
    h.first_token();
    assert!(h.feed(pre(tok(70))).is_empty());
    assert!(h.feed(Event::Message { side: Side::Prefill, msg: ControlMsg::Cancel(ID) }).is_empty());
    assert!(h.feed(Event::Message { side: Side::Decode, msg: ControlMsg::Cancel(ID) }).is_empty());
    h.token(dec(tok(8)));
    assert_eq!(h.tokens(), [7, 8]);
}

#[test]
fn a_ticket_not_forwarded_fails_the_prefill_node_only_before_the_first_token() {
    let mut h = H::new(3);
    h.remote();
    h.feed(ticket_msg());
    let out = h.feed(Event::TicketNotSent);
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    h.remote();
    h.token(pre(tok(7)));
    h.feed(ticket_msg());
    assert!(h.feed(Event::TicketNotSent).is_empty());
    h.feed(handoff_done());
    assert_eq!(kinds(&h.feed(ticket_msg())), ["Record(Reservation)"], "no prefill stream to forward to");
}

#[test]
fn the_prefill_retry_limit_ends_the_request_with_an_error() {
    let mut h = H::new(3);
    for _ in 0..2 {
        h.remote();
        assert_eq!(kinds(&h.feed(pre(node_err("boom")))), ["CloseStreams", "Release", "Record(PrefillRetry)", "Plan"]);
    }
    h.remote();
    let out = h.feed(pre(node_err("boom")));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Record(PrefillRetry)", "Final(Error)", "Finish"]);
    assert_eq!(h.error(), "gave up after 3 prefill attempts: prefill node p0: boom");
    let Some(Observation::Completion { ttft, ok, output_tokens, .. }) = h.m.completion(h.now, false) else { panic!() };
    assert_eq!((ttft, ok, output_tokens), (Duration::ZERO, false, 0));
}

#[test]
fn prefill_and_decode_failures_before_the_first_token_share_the_retry_budget() {
    let mut h = H::new(3);
    h.remote();
    h.feed(pre(node_err("boom")));
    h.remote_on(d1());
    h.feed(Event::NodeDied(d1().id));
    h.remote();
    let out = h.feed(Event::NodeDied(d0().id));
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Final(Error)", "Finish"]);
    assert_eq!(h.error(), "gave up after 3 attempts: decode node d0: the node died");
}

// ---- Cancellation racing each path -------------------------------------------------------------

#[test]
fn a_cancel_before_the_ticket_cancels_both_nodes() {
    let mut h = H::new(3);
    h.remote();
    let out = h.feed(Event::Cancelled);
    assert_eq!(kinds(&out), ["Cancel(decode)", "Cancel(prefill)", "CloseStreams", "Release", "Finish"]);
    assert!(h.feed(Event::NodeDied(d0().id)).is_empty(), "a death after it is nothing");
    assert_eq!(h.client.len(), 1, "no event after Routed");
    assert!(h.m.completion(h.now, true).is_none(), "a client that left before its first token tells nothing");
}

#[test]
fn a_cancel_after_the_handoff_report_cancels_the_decode_node_only() {
    let mut h = H::new(5);
    h.first_token();
    h.feed(handoff_done());
    let out = h.feed(Event::Cancelled);
    assert_eq!(kinds(&out), ["Cancel(decode)", "CloseStreams", "Release", "Finish"]);
}

#[test]
fn a_cancel_during_the_early_token_buffer_sends_nothing_held() {
    let mut h = H::new(5);
    h.remote();
    h.feed(ticket_msg());
    h.feed(dec(tok(8)));
    let out = h.feed(Event::Cancelled);
    assert_eq!(kinds(&out), ["Cancel(decode)", "Cancel(prefill)", "CloseStreams", "Release", "Finish"]);
    assert!(h.tokens().is_empty());
}

#[test]
fn a_cancel_while_a_token_is_delivered_takes_effect_once_it_is() {
    let mut h = H::new(5);
    h.remote();
    h.feed(dec(tok(8)));
    h.feed(pre(tok(7)));
    assert!(h.feed(Event::Cancelled).is_empty(), "the answer is still out");
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["Emit(8)"], "the flush goes on");
    let out = h.feed(Event::Delivered);
    assert_eq!(kinds(&out), ["Cancel(decode)", "Cancel(prefill)", "CloseStreams", "Release", "Finish"]);
}

#[test]
fn a_cancel_racing_a_decode_death_before_the_first_token() {
    // The death first: the retry's plan is out when the cancel comes; the attempt it plans is
    // cancelled as soon as its streams are open.
    let mut h = H::new(3);
    h.remote();
    h.feed(Event::NodeDied(d0().id));
    assert!(h.feed(Event::Cancelled).is_empty());
    let out = h.plan(Plan::Remote { prefill: p0(), decode: d1() });
    assert_eq!(kinds(&out), ["Routed(remote)", "Record(RouteDecision)", "Open(remote)"]);
    let out = h.feed(Event::Opened { decode: Ok(()), prefill: Some(Ok(())) });
    assert_eq!(kinds(&out), ["Cancel(decode)", "Cancel(prefill)", "CloseStreams", "Release", "Finish"]);
    assert!(h.tokens().is_empty());

    // The cancel while the retry's streams open, which fail: no further attempt.
    let mut h = H::new(3);
    h.remote();
    h.feed(Event::NodeDied(d0().id));
    h.plan(Plan::Remote { prefill: p0(), decode: d1() });
    assert!(h.feed(Event::Cancelled).is_empty());
    let out = h.feed(Event::Opened { decode: Err(AttemptError::StreamClosed), prefill: Some(Ok(())) });
    assert_eq!(kinds(&out), ["CloseStreams", "Release", "Finish"]);
}

#[test]
fn a_cancel_racing_a_decode_death_after_the_first_token() {
    // Cancel first: the death is nothing.
    let mut h = H::new(5);
    h.first_token();
    assert_eq!(kinds(&h.feed(Event::Cancelled))[0], "Cancel(decode)");
    assert!(h.feed(Event::NodeDied(d0().id)).is_empty());
    // Death first: the migration's plan answers after the cancel, and its attempt is cancelled.
    let mut h = H::new(5);
    h.first_token();
    h.feed(Event::NodeDied(d0().id));
    assert!(h.feed(Event::Cancelled).is_empty());
    h.plan(Plan::Local { decode: d1(), reason: LocalReason::Migration });
    let out = h.feed(Event::Opened { decode: Ok(()), prefill: None });
    assert_eq!(kinds(&out), ["Cancel(decode)", "CloseStreams", "Release", "Finish"]);
    assert_eq!(h.tokens(), [7]);
    assert!(h.events().iter().all(|e| e.finish_reason.is_none()), "no final event for a cancelled request");
}

#[test]
fn a_cancel_racing_the_last_token() {
    let mut h = H::new(2);
    h.first_token();
    h.feed(dec(fin(8, FinishReason::Length)));
    assert!(h.feed(Event::Cancelled).is_empty());
    assert_eq!(kinds(&h.feed(Event::Delivered)), ["ReportLater", "CloseStreams", "Release", "Finish"]);
    // Every token sent without a final event: a cancel before the death cancels both nodes
    // and ends the request without a Length event...
    let mut h = H::new(2);
    h.first_token();
    h.token(dec(tok(8)));
    let out = h.feed(Event::Cancelled);
    assert_eq!(kinds(&out), ["Cancel(decode)", "Cancel(prefill)", "CloseStreams", "Release", "Finish"]);
    assert!(h.feed(Event::NodeDied(d0().id)).is_empty());
    assert!(h.events().iter().all(|e| e.finish_reason.is_none()));
    // ...a death before the cancel ends it with Length, and the cancel is nothing.
    let mut h = H::new(2);
    h.first_token();
    h.token(dec(tok(8)));
    assert_eq!(kinds(&h.feed(Event::NodeDied(d0().id)))[3], "Final(Length)");
    assert!(h.feed(Event::Cancelled).is_empty());
}

#[test]
fn a_cancel_racing_a_prefill_failure() {
    // Before the first token: cancel first, the failure is nothing.
    let mut h = H::new(3);
    h.remote();
    h.feed(Event::Cancelled);
    h.feed(pre(node_err("boom")));
    assert_eq!(h.client.len(), 1);
    // The failure first, the cancel while the retry is planned, no node left: nothing was sent,
    // so the request is refused, naming the failure.
    let mut h = H::new(3);
    h.remote();
    h.feed(pre(node_err("boom")));
    assert!(h.feed(Event::Cancelled).is_empty());
    assert_eq!(
        kinds(&h.feed(no_route("nothing", Some(Wait::Switch)))),
        ["Refused", "Finish"],
        "a cancelled request is not held"
    );
    assert!(h.error().contains("boom"), "{}", h.error());
    // After the first token the prefill failure is no failure; the cancel goes to the decode
    // node alone.
    let mut h = H::new(3);
    h.first_token();
    h.feed(pre(node_err("handoff failed")));
    assert_eq!(kinds(&h.feed(Event::Cancelled)), ["Cancel(decode)", "CloseStreams", "Release", "Finish"]);
}

#[test]
fn a_cancel_during_a_backoff_ends_the_request() {
    let mut h = H::new(3);
    h.remote();
    h.feed(dec(node_err("out of kv blocks")));
    assert_eq!(kinds(&h.feed(Event::Cancelled)), ["Finish"]);
    assert_eq!(h.client.len(), 1, "nothing but Routed");
}

// ---- No route, and holding while nodes switch roles --------------------------------------------

#[test]
fn no_route_before_anything_was_sent_or_failed_is_a_refusal() {
    let mut h = H::new(3);
    h.advance(Duration::from_millis(7));
    let out = h.feed(no_route("no decode node is alive", None));
    assert_eq!(kinds(&out), ["Refused", "Finish"]);
    assert!(matches!(&h.client[0], DispatchEvent::Refused { reason }
        if reason == "no decode node is alive"));
    let Some(Observation::Completion { ttft, ok, .. }) = h.m.completion(h.now, false) else { panic!() };
    assert_eq!((ttft, ok), (Duration::from_millis(7), false));
}

#[test]
fn no_route_after_a_failed_attempt_with_nothing_sent_is_a_refusal_naming_both() {
    // A refusal is a 503 at the edge: nothing reached the client, so it may retry.
    let mut h = H::new(3);
    h.remote();
    h.feed(Event::NodeDied(d0().id));
    assert_eq!(kinds(&h.feed(no_route("every node excluded", None))), ["Refused", "Finish"]);
    assert_eq!(h.error(), "decode node d0: the node died; then no node can serve this request: every node excluded");
}

#[test]
fn a_request_is_held_while_nodes_switch_roles_until_the_deadline() {
    let mut h = H::new(3);
    let out = h.feed(no_route("switching", Some(Wait::Switch)));
    assert_eq!(kinds(&out), ["Record(HeldForSwitch)"]);
    assert_eq!(h.m.deadline(), Some(h.now + HOLD_POLL));
    assert!(h.feed(Event::Timer).is_empty(), "not yet");
    h.advance(HOLD_POLL);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    assert!(h.feed(no_route("switching", Some(Wait::Switch))).is_empty(), "counted once");
    h.advance(HOLD_LIMIT - HOLD_POLL);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    assert_eq!(kinds(&h.feed(no_route("switching", Some(Wait::Switch)))), ["Refused", "Finish"], "the deadline passed");
}

#[test]
fn a_request_waits_for_a_seat_at_most_its_max_wait_then_is_shed() {
    let seats = || Some(Wait::Seats { max_wait: Duration::from_millis(500) });
    let mut h = H::new(3);
    assert_eq!(kinds(&h.feed(no_route("every node holds its seats", seats()))), ["Record(HeldForSeat)"]);
    h.advance(HOLD_POLL);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    assert!(h.feed(no_route("every node holds its seats", seats())).is_empty(), "counted once");
    // A switch in between does not restart the seat's clock.
    h.advance(HOLD_POLL);
    h.feed(Event::Timer);
    assert!(h.feed(no_route("switching", Some(Wait::Switch))).is_empty());
    h.advance(Duration::from_millis(400));
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    assert_eq!(
        kinds(&h.feed(no_route("every node holds its seats", seats()))),
        ["Record(Shed)", "Refused", "Finish"],
        "500 ms waited: shed"
    );
    assert!(matches!(&h.client[0], DispatchEvent::Refused { reason } if reason.contains("seats")), "{:?}", h.client);
    // One that finds a seat in time goes.
    let mut h = H::new(3);
    h.feed(no_route("every node holds its seats", seats()));
    h.advance(Duration::from_millis(450));
    h.feed(Event::Timer);
    h.remote();
    h.token(pre(fin(7, FinishReason::Stop)));
    assert!(h.finished);
    // A cancelled request is not counted as shed.
    let mut h = H::new(3);
    h.feed(no_route("every node holds its seats", seats()));
    assert_eq!(kinds(&h.feed(Event::Cancelled)), ["Plan"]);
    assert_eq!(kinds(&h.feed(no_route("every node holds its seats", seats()))), ["Refused", "Finish"]);
}

#[test]
fn a_request_shed_for_its_ttft_is_refused_at_once_and_a_held_one_asks_with_its_wait() {
    let mut h = H::new(3);
    let shed = Event::Planned(Err(NoRoute { reason: "past the TTFT target".into(), wait: None, shed: true }));
    assert_eq!(kinds(&h.feed(shed)), ["Record(Shed)", "Refused", "Finish"]);
    let mut h = H::new(3);
    h.feed(no_route("switching", Some(Wait::Switch)));
    h.advance(HOLD_POLL * 3);
    let out = h.feed(Event::Timer);
    assert_eq!(the_query(&out).waited, HOLD_POLL * 3, "a held request asks again with its wait");
}

#[test]
fn a_seat_wait_past_what_an_instant_holds_is_bounded_by_the_hold_limit() {
    let mut h = H::new(3);
    let seats = || Some(Wait::Seats { max_wait: Duration::MAX / 2 });
    assert_eq!(kinds(&h.feed(no_route("every node holds its seats", seats()))), ["Record(HeldForSeat)"]);
    h.advance(HOLD_LIMIT);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    assert_eq!(kinds(&h.feed(no_route("every node holds its seats", seats()))), ["Record(Shed)", "Refused", "Finish"]);
}

#[test]
fn a_held_request_goes_when_a_node_can_take_it() {
    let mut h = H::new(3);
    h.feed(no_route("switching", Some(Wait::Switch)));
    h.advance(HOLD_POLL);
    h.feed(Event::Timer);
    h.remote();
    h.token(pre(fin(7, FinishReason::Stop)));
    assert!(h.finished);
}

#[test]
fn a_cancel_while_held_asks_once_more_then_refuses() {
    let mut h = H::new(3);
    h.feed(no_route("switching", Some(Wait::Switch)));
    assert_eq!(kinds(&h.feed(Event::Cancelled)), ["Plan"]);
    assert_eq!(kinds(&h.feed(no_route("switching", Some(Wait::Switch)))), ["Refused", "Finish"]);
}

// ---- Errors read as before -----------------------------------------------------------------------

#[test]
fn attempt_errors_read_as_the_router_always_wrote_them() {
    let silent = AttemptError::Silent { silence: Duration::from_secs(120) };
    assert_eq!(silent.to_string(), "the node sent nothing for 120 s");
    assert_eq!(AttemptError::NodeDied.to_string(), "the node died");
    assert_eq!(AttemptError::StreamClosed.to_string(), "the node closed the stream");
    assert_eq!(AttemptError::TicketNotSent.to_string(), "stream lost while sending the ticket");
    let broken = AttemptError::StreamBroken(WireError::Closed);
    assert_eq!(broken.to_string(), WireError::Closed.to_string());
    let last =
        NodeFailure { side: Side::Prefill, node: "p0".into(), cause: AttemptError::NodeError { message: "x".into() } };
    assert_eq!(
        RequestError::PrefillAttempts { attempts: 3, last }.to_string(),
        "gave up after 3 prefill attempts: prefill node p0: x"
    );
}

#[test]
fn a_request_waiting_for_decode_kv_is_held_and_counted_as_such() {
    let mut h = H::new(3);
    let out = h.feed(no_route("the decode nodes' KV caches are full", Some(Wait::DecodeKv)));
    assert_eq!(kinds(&out), ["Record(HeldForDecodeKv)"]);
    h.advance(HOLD_POLL);
    assert_eq!(kinds(&h.feed(Event::Timer)), ["Plan"]);
    h.remote();
    h.token(pre(fin(7, FinishReason::Stop)));
    assert!(h.finished);
}
