package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/troupe-hpc/troupe/datatype"
)

// TestRandomMatching checks MPI's matching rules against random mixes of
// receive calls. Ranks 1 and 2 each send rank 0 a few dozen messages of
// random tags (three tags) and sizes (eager to rendezvous), blocking and
// nonblocking. Rank 0, in one goroutine, makes random calls until it has
// received every message: nonblocking receives (plain, IOV and typed),
// blocking receives with short deadlines, Wait on a pending receive with an
// ended or short context (which cancels a plain receive still unmatched,
// often while later receives that could take its messages are pending),
// WaitAny, WaitSome and TestAny, Iprobe and Probe followed by a receive of
// what they report, and matched probes (Improbe, Mprobe) whose messages
// are received later. Sources are exact or AnySource, and buffers are
// sometimes too small. Typed receives are cancelled only by blocking calls,
// which keeps clear of a documented departure from MPI (see
// blockingReceive). Each payload names its sender, tag and index, and the
// run then checks that
//
//   - for each (source, tag) the receives that got a message, taken in the
//     order they were posted (a matched probe counting at its match), got
//     the messages in the order they were sent: messages do not overtake
//     each other, and a message goes to the earliest pending receive that
//     matches it;
//   - every message was received once, intact, by a receive that matches
//     it, with the size a probe reported for it;
//   - a cancelled receive took no message, and was not left pending while a
//     receive posted after it completed with a message it could have taken.
//
// Each configuration (progress mode, overlap engine off or on, plain or
// typed messages) runs seeds 1 and 2 by default: about 12 s in all with
// -race on two cores. For a soak, set TROUPE_MATCH_SEEDS to a list of seeds
// and ranges and raise go test's -timeout; -run selects configurations:
//
//	TROUPE_MATCH_SEEDS=1-200 go test ./transport -run TestRandomMatching -timeout 1h
//	TROUPE_MATCH_SEEDS=7,30-40 go test ./transport -run 'TestRandomMatching/^queue-on-plain$'
//
// A seed fixes the messages and the calls, but not their timing, so a seed
// that failed once may need repeating (-count) to fail again. A failure
// reports the seed, the configuration, the first problems and the end of
// the run's log.
func TestRandomMatching(t *testing.T) {
	seeds := matchSeeds(t)
	for _, typed := range []bool{false, true} {
		for _, overlap := range []bool{false, true} {
			for _, mode := range []ProgressMode{ProgressDirect, ProgressQueue} {
				c := matchConfig{mode: mode, overlap: overlap, typed: typed}
				t.Run(c.String(), func(t *testing.T) {
					if overlap {
						t.Setenv(OverlapEnv, "on")
					} else {
						t.Setenv(OverlapEnv, "off")
					}
					for _, seed := range seeds {
						t.Run(strconv.FormatInt(seed, 10), func(t *testing.T) { runMatching(t, c, seed) })
					}
				})
			}
		}
	}
}

const (
	matchTags    = 3 // messages have tags 0 to matchTags-1
	matchSenders = 2 // ranks 1 to matchSenders send to rank 0

	// Typed configurations send and receive count elements of a vector of
	// vecBlocks blocks of vecBlockLen bytes, vecStride bytes apart.
	vecBlocks   = 4
	vecBlockLen = 16
	vecStride   = 32
	vecSize     = vecBlocks * vecBlockLen               // packed bytes of one element
	vecExtent   = (vecBlocks-1)*vecStride + vecBlockLen // bytes one element spans

	// matchRunLimit bounds one run; a receiver still waiting for messages
	// then is reported with what it was waiting for.
	matchRunLimit = time.Minute
	// matchReportMargin is kept before go test's -timeout to report a stalled run.
	matchReportMargin = 10 * time.Second
	// matchReportLines is how much of a failed run's log is shown.
	matchReportLines = 30
	// matchReportProblems is how many problems of a failed run are shown.
	matchReportProblems = 5
)

// matchConfig is one configuration of the transport and the messages.
type matchConfig struct {
	mode    ProgressMode
	overlap bool // the overlap engine
	typed   bool // SendTyped and typed receives instead of plain ones
}

func (c matchConfig) String() string {
	overlap, messages := "off", "plain"
	if c.overlap {
		overlap = "on"
	}
	if c.typed {
		messages = "typed"
	}
	return fmt.Sprintf("%s-%s-%s", c.mode, overlap, messages)
}

// matchSeeds returns the seeds TROUPE_MATCH_SEEDS lists ("1-200",
// "3,7,10-12"), or 1 and 2 when it is not set.
func matchSeeds(t *testing.T) []int64 {
	spec := os.Getenv("TROUPE_MATCH_SEEDS")
	if spec == "" {
		return []int64{1, 2}
	}
	var seeds []int64
	for _, item := range strings.Split(spec, ",") {
		first, last, isRange := strings.Cut(strings.TrimSpace(item), "-")
		lo, err := strconv.ParseInt(first, 10, 64)
		hi := lo
		if err == nil && isRange {
			hi, err = strconv.ParseInt(last, 10, 64)
		}
		if err != nil || hi < lo {
			t.Fatalf("TROUPE_MATCH_SEEDS=%q: %q is not a seed or a range of seeds (like 3 or 1-200)", spec, item)
		}
		for s := lo; s <= hi; s++ {
			seeds = append(seeds, s)
		}
	}
	return seeds
}

// matchKey is a (source, tag) pair: messages with the same one must be
// received in the order they were sent.
type matchKey struct{ src, tag int }

// plannedMessage is one message a sender sends.
type plannedMessage struct{ tag, size int }

// matchPayload is the packed content of message idx of (src, tag): its
// first eight bytes name it, the rest are a pattern that depends on it.
func matchPayload(src, tag, idx, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*31 + src*7 + tag*13 + idx*17 + i>>8)
	}
	b[0], b[1] = byte(src), byte(tag)
	binary.LittleEndian.PutUint32(b[2:], uint32(idx))
	b[6], b[7] = 0xA5, 0x5A
	return b
}

// unpackVectors lays out packed (a whole number of elements) as the
// vector type does in memory, with 0xEE in the gaps.
func unpackVectors(packed []byte) []byte {
	count := len(packed) / vecSize
	buf := bytes.Repeat([]byte{0xEE}, count*vecExtent)
	for e := range count {
		for k := range vecBlocks {
			at := e*vecExtent + k*vecStride
			copy(buf[at:at+vecBlockLen], packed[(e*vecBlocks+k)*vecBlockLen:])
		}
	}
	return buf
}

// packVectors returns the first n packed bytes of the vectors in buf.
func packVectors(buf []byte, n int) []byte {
	out := make([]byte, 0, n)
	for e := 0; len(out) < n; e++ {
		for k := 0; k < vecBlocks && len(out) < n; k++ {
			at := e*vecExtent + k*vecStride
			out = append(out, buf[at:at+vecBlockLen]...)
		}
	}
	return out
}

// planMessages chooses each sender's messages, and returns them with the
// sizes of each (source, tag)'s messages in the order they are sent.
func planMessages(rng *rand.Rand, typed bool) ([][]plannedMessage, map[matchKey][]int) {
	perSender := 24 + rng.Intn(16)
	plans := make([][]plannedMessage, matchSenders+1)
	sizes := map[matchKey][]int{}
	for s := 1; s <= matchSenders; s++ {
		for range perSender {
			tag := rng.Intn(matchTags)
			var n int
			if typed {
				var elements int
				switch p := rng.Intn(100); {
				case p < 55:
					elements = 1 + rng.Intn(8)
				case p < 85:
					elements = 200 + rng.Intn(400)
				default:
					elements = 4096 + rng.Intn(200)
				}
				n = elements * vecSize
			} else {
				switch p := rng.Intn(100); {
				case p < 55:
					n = 8 + rng.Intn(2000)
				case p < 85:
					n = 10000 + rng.Intn(50000)
				default:
					n = 256<<10 + rng.Intn(40000)
				}
			}
			plans[s] = append(plans[s], plannedMessage{tag, n})
			k := matchKey{s, tag}
			sizes[k] = append(sizes[k], n)
		}
	}
	return plans, sizes
}

// sendPlanned sends rank src's messages to rank 0, about a third with
// blocking sends and the rest with nonblocking ones, at most five of them
// in flight. A typed send whose receive was too small fails with
// ErrTruncated, which is expected.
func sendPlanned(ctx context.Context, tr *Transport, src int, msgs []plannedMessage, vt *datatype.Type, typed bool, rng *rand.Rand) error {
	failed := func(err error) bool { return err != nil && !(typed && errors.Is(err, ErrTruncated)) }
	var inFlight []*Request
	next := map[int]int{} // tag -> index of its next message
	for _, m := range msgs {
		idx := next[m.tag]
		next[m.tag]++
		payload := matchPayload(src, m.tag, idx, m.size)
		blocking := rng.Intn(100) < 35
		var req *Request
		var err error
		switch {
		case typed && blocking:
			err = tr.SendTyped(ctx, 0, m.tag, unpackVectors(payload), vt, m.size/vecSize)
		case typed:
			req, err = tr.IsendTyped(0, m.tag, unpackVectors(payload), vt, m.size/vecSize)
		case blocking:
			err = tr.Send(ctx, 0, m.tag, payload)
		default:
			req, err = tr.Isend(0, m.tag, payload)
		}
		if failed(err) {
			return fmt.Errorf("send of (tag %d, idx %d): %w", m.tag, idx, err)
		}
		if req != nil {
			inFlight = append(inFlight, req)
		}
		if len(inFlight) > 4 {
			if _, err := inFlight[0].Wait(ctx); failed(err) {
				return fmt.Errorf("wait for a send: %w", err)
			}
			inFlight = inFlight[1:]
		}
	}
	for _, req := range inFlight {
		if _, err := req.Wait(ctx); failed(err) {
			return fmt.Errorf("wait for a send: %w", err)
		}
	}
	return nil
}

// runMatching runs one seed of configuration c and reports what went wrong.
func runMatching(t *testing.T, c matchConfig, seed int64) {
	deadline := time.Now().Add(matchRunLimit)
	if d, ok := t.Deadline(); ok && d.Add(-matchReportMargin).Before(deadline) {
		deadline = d.Add(-matchReportMargin)
	}
	ctx, cancel := context.WithDeadline(t.Context(), deadline)
	defer cancel()

	ts := localJobWith(t, 1+matchSenders, Options{Progress: c.mode})
	if _, on := ts[0].OverlapStats(); on != c.overlap {
		t.Fatalf("overlap engine on: %v, want %v", on, c.overlap)
	}
	vt, err := datatype.Vector(vecBlocks, vecBlockLen, vecStride, datatype.Byte)
	if err != nil {
		t.Fatal(err)
	}
	if err := vt.Commit(); err != nil {
		t.Fatal(err)
	}

	rng := rand.New(rand.NewSource(seed))
	plans, sizes := planMessages(rng, c.typed)
	senderErrs := make(chan error, matchSenders)
	for s := 1; s <= matchSenders; s++ {
		senderRng := rand.New(rand.NewSource(seed*100 + int64(s)))
		go func() {
			if err := sendPlanned(ctx, ts[s], s, plans[s], vt, c.typed, senderRng); err != nil {
				senderErrs <- fmt.Errorf("rank %d: %w", s, err)
				return
			}
			senderErrs <- nil
		}()
	}

	m := &matchReceiver{c: c, rng: rng, tr: ts[0], vt: vt, sizes: sizes, received: map[matchKey]int{}}
	for _, keySizes := range sizes {
		m.total += len(keySizes)
	}
	var problems []string
	if err := m.run(ctx); err != nil {
		// The run ended early: cancel the senders, whose messages will not
		// all be received, and check what was received.
		cancel()
		problems = append(problems, err.Error())
		m.departed = renumberDepartures(ts[0])
		problems = append(problems, m.check(false)...)
	} else {
		problems = append(problems, m.cancelLeftovers()...)
		problems = append(problems, waitSenders(ctx, senderErrs)...)
		m.departed = renumberDepartures(ts[0])
		problems = append(problems, m.check(true)...)
	}
	t.Logf("%d messages in %d steps; %d receives cancelled, %d of them with a later receive that could take their messages pending (%d prepared typed ones); (source, tag)s left unrenumbered: %d",
		m.total, m.step, m.cancelled, m.cancelledAhead, m.cancelledPrepared, len(m.departed))
	if len(problems) > 0 {
		t.Fatal(m.report(c, seed, problems))
	}
}

// waitSenders waits for the senders' results, or until ctx ends.
func waitSenders(ctx context.Context, results <-chan error) []string {
	var problems []string
	for range matchSenders {
		select {
		case err := <-results:
			if err != nil {
				problems = append(problems, err.Error())
			}
		case <-ctx.Done():
			return append(problems, "a sender had not finished when the run's time ran out")
		}
	}
	return problems
}

// renumberDepartures returns the (source, tag)s of the MPI-style space
// whose typed receives kept their numbers after a cancellation (renumber.go
// counts them): there the message the cancelled receive was owed went to
// the next typed receive placed, which MPI's order does not allow.
func renumberDepartures(tr *Transport) map[matchKey]bool {
	out := map[matchKey]bool{}
	v, ok := noncontigs.Load(tr)
	if !ok {
		return out
	}
	nc := v.(*noncontig)
	nc.mu.Lock()
	defer nc.mu.Unlock()
	for k := range nc.renumberSkips {
		if k.tag >= 0 {
			out[matchKey{k.peer, k.tag}] = true
		}
	}
	return out
}

// receiveRecord is one receive rank 0 made, and what came of it.
type receiveRecord struct {
	id       int    // records are numbered in the order their receives were posted (a matched probe's at its match)
	kind     string // the call that posted it
	src, tag int    // what it asked for; src may be AnySource
	bufLen   int    // packed bytes its buffer holds
	typed    bool   // a typed receive, into vectors
	postStep int

	req       *Request       // a nonblocking receive's request
	prep      *TypedTransfer // a prepared typed receive, until it is run
	bufs      [][]byte       // its buffers
	msg       *Message       // a matched probe's message
	typedMsg  *TypedMessage  // a matched typed probe's message
	probeCall string         // the probe that named the message it must get, if one did
	probeSize int            // the size the probe reported

	done       bool
	doneStep   int
	cancelled  bool // ended by its context without a message
	cancelStep int  // the step that asked for its cancellation
	status     Status
	err        error
	data       []byte // the packed message it got
	truncSrc   int    // a message too large for it: its source
	truncSize  int    // and its size (0: none)
}

func (r *receiveRecord) String() string {
	s := fmt.Sprintf("#%d %s(src %s, tag %d, %d B) posted @%d", r.id, r.kind, sourceString(r.src), r.tag, r.bufLen, r.postStep)
	switch {
	case !r.done:
		return s
	case r.cancelled:
		return s + fmt.Sprintf(", cancelled @%d (asked @%d)", r.doneStep, r.cancelStep)
	case r.truncSize != 0:
		return s + fmt.Sprintf(", truncated @%d: %d B from %d", r.doneStep, r.truncSize, r.truncSrc)
	case r.err != nil:
		return s + fmt.Sprintf(", failed @%d: %v", r.doneStep, r.err)
	}
	if len(r.data) >= 8 {
		return s + fmt.Sprintf(", got (src %d, tag %d, idx %d) of %d B @%d",
			r.data[0], r.data[1], binary.LittleEndian.Uint32(r.data[2:]), len(r.data), r.doneStep)
	}
	return s + fmt.Sprintf(", got %+v @%d", r.status, r.doneStep)
}

// sourceString is src as records show it: a rank or "any".
func sourceString(src int) string {
	if src == AnySource {
		return "any"
	}
	return strconv.Itoa(src)
}

// matchReceiver is rank 0: it makes random receive calls until every
// message has been received, and records them.
type matchReceiver struct {
	c     matchConfig
	rng   *rand.Rand
	tr    *Transport
	vt    *datatype.Type
	sizes map[matchKey][]int // the sizes of each (source, tag)'s messages, in send order
	total int                // messages sent

	step     int
	records  []*receiveRecord
	pending  []*receiveRecord // nonblocking receives not yet completed
	prepared []*receiveRecord // prepared typed receives not yet run
	held     []*receiveRecord // matched probes whose messages are not yet received
	received map[matchKey]int // messages of each (source, tag) received (or truncated)
	got      int              // messages received (or truncated) in all
	log      []string

	cancelled      int // receives cancelled
	cancelledAhead int // of them, with a later pending receive that could take their messages
	// cancelledPrepared: prepared typed receives cancelled with a later
	// receive that could take their messages pending.
	cancelledPrepared int
	// departed: (source, tag)s whose typed receives kept their numbers
	// after a cancellation (NoncontigStats.RenumberSkipped), where the
	// order checks do not apply; set before check.
	departed map[matchKey]bool
}

func (m *matchReceiver) logf(format string, a ...any) {
	m.log = append(m.log, fmt.Sprintf("%d: ", m.step)+fmt.Sprintf(format, a...))
}

// run makes random calls until every message has been received. It
// returns the first problem that makes going on pointless, such as a probe
// reporting a message that does not match it, or the run's time running
// out.
func (m *matchReceiver) run(ctx context.Context) error {
	for m.got < m.total || len(m.held) > 0 {
		if ctx.Err() != nil {
			return m.stalled()
		}
		m.step++
		op := m.rng.Intn(100)
		src, tag := m.pick()
		var err error
		switch {
		case op < 22 && m.c.typed && m.rng.Intn(100) < 35:
			err = m.prepareTyped(src, tag)
		case op < 22:
			err = m.postReceive(src, tag)
		case op < 34:
			m.blockingReceive(ctx, src, tag)
		case op < 50 && len(m.prepared) > 0 && m.rng.Intn(2) == 0:
			m.runPrepared(ctx)
		case op < 50:
			m.waitOne(ctx)
		case op < 60:
			err = m.waitSeveral(ctx)
		case op < 70:
			err = m.probeThenReceive(ctx, src, tag)
		case op < 80:
			err = m.matchedProbe(ctx, src, tag)
		case op < 90:
			err = m.receiveHeld(ctx)
		default:
			runtime.Gosched() // let messages arrive
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// stalled describes what the receiver was waiting for when the run's time
// ran out.
func (m *matchReceiver) stalled() error {
	var b strings.Builder
	fmt.Fprintf(&b, "run timed out after %d steps with %d of %d messages received", m.step, m.got, m.total)
	for src := 1; src <= matchSenders; src++ {
		for tag := range matchTags {
			k := matchKey{src, tag}
			if n := len(m.sizes[k]); m.received[k] < n {
				fmt.Fprintf(&b, "; (src %d, tag %d) %d of %d", src, tag, m.received[k], n)
			}
		}
	}
	fmt.Fprintf(&b, "\n%d matched probes not yet received, %d receives pending:", len(m.held), len(m.pending))
	for i, r := range m.pending {
		if i == 10 {
			fmt.Fprintf(&b, "\n  and %d more", len(m.pending)-i)
			break
		}
		b.WriteString("\n  " + r.String())
	}
	return errors.New(b.String())
}

// pick chooses the source and tag of a receive or probe: mostly a (source,
// tag) with messages still to receive, and a third of the time AnySource.
func (m *matchReceiver) pick() (src, tag int) {
	var left []matchKey
	for s := 1; s <= matchSenders; s++ {
		for tg := range matchTags {
			k := matchKey{s, tg}
			if m.received[k] < len(m.sizes[k]) {
				left = append(left, k)
			}
		}
	}
	if len(left) > 0 && m.rng.Intn(100) < 80 {
		k := left[m.rng.Intn(len(left))]
		src, tag = k.src, k.tag
	} else {
		src, tag = 1+m.rng.Intn(matchSenders), m.rng.Intn(matchTags)
	}
	if m.rng.Intn(100) < 35 {
		src = AnySource
	}
	return src, tag
}

// bufferSize chooses a receive's buffer: mostly large enough for any
// message (planMessages makes them up to 4295 elements or 302143 B),
// sometimes too small for some. It is in elements of the vector type for
// typed receives, in bytes for plain ones.
func (m *matchReceiver) bufferSize() int {
	p := m.rng.Intn(100)
	if m.c.typed {
		switch {
		case p < 70:
			return 4300
		case p < 85:
			return 600
		default:
			return 8
		}
	}
	switch {
	case p < 70:
		return 300 << 10
	case p < 85:
		return 64 << 10
	default:
		return 2048
	}
}

// newRecord records a receive posted now, giving it n elements or bytes
// of buffer (none for a matched probe), in three pieces when iov is set.
func (m *matchReceiver) newRecord(kind string, src, tag, n int, iov bool) *receiveRecord {
	r := &receiveRecord{id: len(m.records), kind: kind, src: src, tag: tag, typed: m.c.typed, postStep: m.step}
	m.records = append(m.records, r)
	if n > 0 {
		m.setBuffers(r, n, iov)
	}
	return r
}

// setBuffers gives r a buffer of n elements (typed) or bytes (plain), in
// three pieces when iov is set.
func (m *matchReceiver) setBuffers(r *receiveRecord, n int, iov bool) {
	switch {
	case r.typed:
		r.bufs, r.bufLen = [][]byte{bytes.Repeat([]byte{0xEE}, n*vecExtent)}, n*vecSize
	case iov:
		a := n / 3
		r.bufs, r.bufLen = [][]byte{make([]byte, a), make([]byte, a+1), make([]byte, n-2*a-1)}, n
	default:
		r.bufs, r.bufLen = [][]byte{make([]byte, n)}, n
	}
}

// finish records how r ended: a message, a message too large for it,
// cancellation, or another error.
func (m *matchReceiver) finish(r *receiveRecord, st Status, err error) {
	r.done, r.doneStep = true, m.step
	r.status, r.err = st, err
	var trunc *TruncatedError
	var mismatch *TypeMismatchError
	switch {
	case err == nil:
		m.got++
		flat := slices.Concat(r.bufs...)
		r.bufs = nil
		if st.Size > r.bufLen {
			r.err = fmt.Errorf("status size %d larger than the buffer", st.Size)
			return
		}
		if r.typed {
			r.data = packVectors(flat, st.Size)
		} else {
			r.data = flat[:st.Size]
		}
		if len(r.data) >= 8 {
			m.received[matchKey{int(r.data[0]), int(r.data[1])}]++
		}
	case errors.As(err, &trunc):
		m.got++
		r.truncSrc, r.truncSize = trunc.Source, trunc.Size
		m.received[matchKey{trunc.Source, r.tag}]++
	case errors.As(err, &mismatch) && mismatch.TooSmall:
		m.got++
		r.truncSrc, r.truncSize = mismatch.Peer, int(mismatch.SendBytes)
		m.received[matchKey{mismatch.Peer, r.tag}]++
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		r.cancelled = true
		m.cancelled++
		if m.laterPending(r) {
			m.cancelledAhead++
		}
	}
}

// laterPending reports whether a receive posted after r that could take
// r's messages is pending.
func (m *matchReceiver) laterPending(r *receiveRecord) bool {
	for _, p := range m.open() {
		if p.id > r.id && p.tag == r.tag && (r.src == AnySource || p.src == AnySource || p.src == r.src) {
			return true
		}
	}
	return false
}

func (m *matchReceiver) removePending(r *receiveRecord) {
	m.pending = slices.DeleteFunc(m.pending, func(p *receiveRecord) bool { return p == r })
}

// pendingOnTag reports whether a receive of tag is pending.
func (m *matchReceiver) pendingOnTag(tag int) bool {
	return slices.ContainsFunc(m.open(), func(p *receiveRecord) bool { return p.tag == tag })
}

// open returns the receives that may still take a message: the pending
// ones and the prepared typed ones not yet run.
func (m *matchReceiver) open() []*receiveRecord {
	return slices.Concat(m.pending, m.prepared)
}

// messageLeftFor reports whether a message from src (or AnySource) with
// tag is sure to be left for a receive posted now, after the pending
// receives and the matched probes have taken theirs.
//
// A typed receive cannot be cancelled through Wait, so the harness posts a
// nonblocking typed receive only when it will get a message, and its
// final cancellation of pending receives never meets a typed one.
func (m *matchReceiver) messageLeftFor(src, tag int) bool {
	pendingExact := map[int]int{} // source -> pending receives of it with tag
	pendingAny := 0
	for _, r := range m.open() {
		switch {
		case r.tag != tag:
		case r.src == AnySource:
			pendingAny++
		default:
			pendingExact[r.src]++
		}
	}
	// free: messages of src with tag that no exact receive or matched probe has claimed
	free := func(src int) int {
		k := matchKey{src, tag}
		n := len(m.sizes[k]) - m.received[k] - pendingExact[src]
		for _, r := range m.held {
			if r.src == src && r.tag == tag {
				n--
			}
		}
		return max(n, 0)
	}
	if src != AnySource {
		return free(src)-pendingAny >= 1
	}
	total := 0
	for s := 1; s <= matchSenders; s++ {
		total += free(s)
	}
	return total-pendingAny >= 1
}

// endingAfter is ctx ending after d, or already ended when d is 0.
func endingAfter(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if d == 0 {
		ended, cancel := context.WithCancel(ctx)
		cancel()
		return ended, cancel
	}
	return context.WithTimeout(ctx, d)
}

// postReceive posts a nonblocking receive: Irecv or IrecvIOV, or
// IrecvTyped when a message is sure to be left for it.
func (m *matchReceiver) postReceive(src, tag int) error {
	n := m.bufferSize()
	var r *receiveRecord
	var req *Request
	var err error
	switch iov := !m.c.typed && m.rng.Intn(100) < 20; {
	case m.c.typed:
		if !m.messageLeftFor(src, tag) {
			return nil
		}
		r = m.newRecord("IrecvTyped", src, tag, n, false)
		req, err = m.tr.IrecvTyped(src, tag, r.bufs[0], m.vt, n)
	case iov:
		r = m.newRecord("IrecvIOV", src, tag, n, true)
		req, err = m.tr.IrecvIOV(src, tag, r.bufs)
	default:
		r = m.newRecord("Irecv", src, tag, n, false)
		req, err = m.tr.Irecv(src, tag, r.bufs[0])
	}
	if err != nil {
		return fmt.Errorf("%s: %w", r, err)
	}
	r.req = req
	m.pending = append(m.pending, r)
	m.logf("post %v", r)
	return nil
}

// blockingReceive calls Recv or RecvTyped with a context that has ended
// or ends soon, which cancels it when no message comes first.
//
// A cancelled typed receive's pending successors keep their numbers in a
// few states (one of them matched already, a message parked by
// IprobeTyped; docs/noncontig.md), and the message the cancelled
// receive was owed then goes to the next typed receive posted. The checks
// do not model this departure; instead the harness cancels only typed
// receives no later typed receive can be pending behind (renumbering is
// tested in renumber_typed_test.go). Wait does not cancel a typed receive, so only blocking calls
// (this one and MprobeTyped in matchedProbe) do, and nothing is posted
// while a blocking call waits: its receive is always the last one posted.
func (m *matchReceiver) blockingReceive(ctx context.Context, src, tag int) {
	n := m.bufferSize()
	timeouts := []time.Duration{0, time.Millisecond, 3 * time.Millisecond, 20 * time.Millisecond}
	rctx, cancel := endingAfter(ctx, timeouts[m.rng.Intn(len(timeouts))])
	defer cancel()
	var r *receiveRecord
	var st Status
	var err error
	if m.c.typed {
		r = m.newRecord("RecvTyped", src, tag, n, false)
		r.cancelStep = m.step
		st, err = m.tr.RecvTyped(rctx, src, tag, r.bufs[0], m.vt, n)
	} else {
		r = m.newRecord("Recv", src, tag, n, false)
		r.cancelStep = m.step
		st, err = m.tr.Recv(rctx, src, tag, r.bufs[0])
	}
	m.finish(r, st, err)
	m.logf("blocking %v", r)
}

// prepareTyped places a typed receive with PrepareRecvTyped (its RTS
// receive goes to UCX now, or once a pending any-source typed receive of
// the tag has matched), to be run later by runPrepared. Unlike a
// nonblocking typed receive it can be cancelled at any time, also with
// later typed receives of its (source, tag) pending behind it, which then
// take over the numbers before theirs (renumber.go); so it is placed
// whether or not a message is left for it.
func (m *matchReceiver) prepareTyped(src, tag int) error {
	if src == AnySource {
		src = 1 + m.rng.Intn(matchSenders) // prepared receives name their source
	}
	n := m.bufferSize()
	r := m.newRecord("PrepareRecvTyped", src, tag, n, false)
	x, err := m.tr.PrepareRecvTyped(src, tag, r.bufs[0], m.vt, n, TypedOptions{})
	if err != nil {
		return fmt.Errorf("%s: %w", r, err)
	}
	r.prep = x
	m.prepared = append(m.prepared, r)
	m.logf("prepare %v", r)
	return nil
}

// runPrepared runs a prepared typed receive with a context that has ended
// or ends soon: it receives its message if it has come by then, else it is
// cancelled, often with later receives that could take its message pending.
func (m *matchReceiver) runPrepared(ctx context.Context) {
	i := m.rng.Intn(len(m.prepared))
	r := m.prepared[i]
	m.prepared = slices.Delete(m.prepared, i, i+1)
	timeouts := []time.Duration{0, time.Millisecond, 5 * time.Millisecond, 20 * time.Millisecond}
	rctx, cancel := endingAfter(ctx, timeouts[m.rng.Intn(len(timeouts))])
	defer cancel()
	r.cancelStep = m.step
	ahead := m.laterPending(r)
	st, err := r.prep.Run(rctx)
	r.prep = nil
	m.finish(r, st, err)
	if r.cancelled && ahead {
		m.cancelledPrepared++
	}
	m.logf("run prepared %v", r)
}

// waitOne waits for one pending receive with a context that has ended or
// ends soon. A plain receive not matched by then is cancelled, often while
// a receive posted after it that could take its messages is pending; a
// typed one is not cancelled (docs/noncontig.md), and stays pending.
func (m *matchReceiver) waitOne(ctx context.Context) {
	if len(m.pending) == 0 {
		return
	}
	r := m.pending[m.rng.Intn(len(m.pending))]
	// Half the time, choose a receive that a later pending receive could
	// take the place of if it were cancelled, when there is one.
	var ahead []*receiveRecord
	for _, p := range m.pending {
		if m.laterPending(p) {
			ahead = append(ahead, p)
		}
	}
	if len(ahead) > 0 && m.rng.Intn(2) == 0 {
		r = ahead[m.rng.Intn(len(ahead))]
	}
	var d time.Duration
	switch p := m.rng.Intn(100); {
	case m.c.typed:
		d = 5 * time.Millisecond
	case p < 25:
		d = 0
	case p < 55:
		d = 2 * time.Millisecond
	default:
		d = 30 * time.Millisecond
	}
	wctx, cancel := endingAfter(ctx, d)
	r.cancelStep = m.step
	st, err := r.req.Wait(wctx)
	cancel()
	if m.c.typed {
		if done, _ := r.req.Finished(); !done {
			m.logf("wait timed out, still pending: %v", r)
			return
		}
		// It may have finished after Wait gave up: take its own result.
		st, err = r.req.Wait(ctx)
	}
	m.finish(r, st, err)
	m.removePending(r)
	m.logf("wait %v", r)
}

// waitSeveral calls WaitAny or WaitSome with a short deadline, or TestAny,
// on every pending receive; none of these cancels anything.
func (m *matchReceiver) waitSeveral(ctx context.Context) error {
	if len(m.pending) == 0 {
		return nil
	}
	reqs := make([]*Request, len(m.pending))
	for i, r := range m.pending {
		reqs[i] = r.req
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Millisecond)
	defer cancel()
	var done []int
	var sts []Status
	call := [...]string{"WaitAny", "WaitSome", "TestAny"}[m.rng.Intn(3)]
	switch call {
	case "WaitAny":
		if i, st, _ := WaitAny(wctx, reqs); i >= 0 {
			done, sts = []int{i}, []Status{st}
		}
	case "WaitSome":
		done, sts, _ = WaitSome(wctx, reqs)
	case "TestAny":
		if i, st, _ := TestAny(reqs); i >= 0 {
			done, sts = []int{i}, []Status{st}
		}
	}
	var finished []*receiveRecord
	for k, i := range done {
		r := m.pending[i]
		ok, err := r.req.Finished()
		if !ok {
			return fmt.Errorf("%s reported the unfinished receive %v", call, r)
		}
		m.finish(r, sts[k], err)
		finished = append(finished, r)
		m.logf("%s %v", call, r)
	}
	for _, r := range finished {
		m.removePending(r)
	}
	return nil
}

// probeThenReceive calls Iprobe or Probe (or their typed forms) and, when
// they report a message, receives from its source with a buffer large
// enough for any message: the receive must get the probed message. It
// does nothing while a receive of the tag is pending, which could take
// the probed message first.
func (m *matchReceiver) probeThenReceive(ctx context.Context, src, tag int) error {
	if m.pendingOnTag(tag) {
		return nil
	}
	var st Status
	var found bool
	var err error
	call := "Iprobe"
	if m.rng.Intn(3) == 0 {
		call = "Probe"
		pctx, cancel := context.WithTimeout(ctx, 3*time.Millisecond)
		if m.c.typed {
			st, err = m.tr.ProbeTyped(pctx, src, tag)
		} else {
			st, err = m.tr.Probe(pctx, src, tag)
		}
		cancel()
		found = err == nil
		if errors.Is(err, context.DeadlineExceeded) {
			err = nil
		}
	} else if m.c.typed {
		st, found, err = m.tr.IprobeTyped(src, tag)
	} else {
		st, found, err = m.tr.Iprobe(src, tag)
	}
	if m.c.typed {
		call += "Typed"
	}
	call = fmt.Sprintf("%s(src %s, tag %d)", call, sourceString(src), tag)
	switch {
	case err != nil:
		return fmt.Errorf("%s: %w", call, err)
	case !found:
		return nil
	case st.Tag != tag || st.Source < 1 || src != AnySource && st.Source != src:
		return fmt.Errorf("%s reported %+v", call, st)
	}
	var r *receiveRecord
	var got Status
	if m.c.typed {
		r = m.newRecord("RecvTyped-after-probe", st.Source, tag, 4300, false)
		r.probeCall, r.probeSize = call, st.Size
		got, err = m.tr.RecvTyped(ctx, st.Source, tag, r.bufs[0], m.vt, 4300)
	} else {
		r = m.newRecord("Recv-after-probe", st.Source, tag, 300<<10, false)
		r.probeCall, r.probeSize = call, st.Size
		got, err = m.tr.Recv(ctx, st.Source, tag, r.bufs[0])
	}
	m.finish(r, got, err)
	m.logf("%s reported %+v, then %v", call, st, r)
	if err != nil {
		return fmt.Errorf("the receive after %s reported %+v: %w", call, st, err)
	}
	return nil
}

// matchedProbe calls Improbe or Mprobe with a short deadline (or their
// typed forms) and holds the message it takes, for receiveHeld.
func (m *matchReceiver) matchedProbe(ctx context.Context, src, tag int) error {
	var msg *Message
	var typedMsg *TypedMessage
	var found bool
	var err error
	kind := "Improbe"
	if m.rng.Intn(3) == 0 {
		kind = "Mprobe"
		pctx, cancel := context.WithTimeout(ctx, 3*time.Millisecond)
		if m.c.typed {
			typedMsg, err = m.tr.MprobeTyped(pctx, src, tag)
		} else {
			msg, err = m.tr.Mprobe(pctx, src, tag)
		}
		cancel()
		found = err == nil
		if errors.Is(err, context.DeadlineExceeded) {
			err = nil
		}
	} else if m.c.typed {
		typedMsg, found, err = m.tr.ImprobeTyped(src, tag)
	} else {
		msg, found, err = m.tr.Improbe(src, tag)
	}
	if m.c.typed {
		kind += "Typed"
	}
	call := fmt.Sprintf("%s(src %s, tag %d)", kind, sourceString(src), tag)
	if err != nil {
		return fmt.Errorf("%s: %w", call, err)
	}
	if !found {
		return nil
	}
	var st Status
	if m.c.typed {
		st = typedMsg.Status()
		if n, ok := typedMsg.Count(m.vt); !ok || n*vecSize != st.Size {
			return fmt.Errorf("TypedMessage.Count = %d, %v for a message of %d B", n, ok, st.Size)
		}
	} else {
		st = msg.Status()
	}
	if st.Tag != tag || st.Source < 1 || src != AnySource && st.Source != src {
		return fmt.Errorf("%s reported %+v", call, st)
	}
	r := m.newRecord(kind, st.Source, tag, 0, false)
	r.msg, r.typedMsg = msg, typedMsg
	r.probeCall, r.probeSize = call, st.Size
	m.held = append(m.held, r)
	m.logf("%s took a message of %d B: %v", call, st.Size, r)
	return nil
}

// receiveHeld receives the message of a matched probe, blocking or not,
// into a buffer that may be too small.
func (m *matchReceiver) receiveHeld(ctx context.Context) error {
	if len(m.held) == 0 {
		return nil
	}
	i := m.rng.Intn(len(m.held))
	r := m.held[i]
	m.held = slices.Delete(m.held, i, i+1)
	n := m.bufferSize()
	m.setBuffers(r, n, false)
	nonblocking := m.rng.Intn(2) == 0
	var st Status
	var err error
	var req *Request
	switch {
	case m.c.typed && nonblocking:
		if req, err = r.typedMsg.Irecv(r.bufs[0], m.vt, n); err == nil {
			st, err = req.Wait(ctx)
		}
	case m.c.typed:
		st, err = r.typedMsg.Recv(ctx, r.bufs[0], m.vt, n)
	case nonblocking:
		if req, err = r.msg.Irecv(r.bufs[0]); err == nil {
			st, err = req.Wait(ctx)
		}
	default:
		st, err = r.msg.Recv(ctx, r.bufs[0])
	}
	m.finish(r, st, err)
	m.logf("receive held %v", r)
	if r.cancelled {
		return fmt.Errorf("the receive of a matched probe's message did not finish: %v", r)
	}
	return nil
}

// cancelLeftovers cancels the receives still pending once every message
// has been received: each must end without a message.
func (m *matchReceiver) cancelLeftovers() []string {
	m.step++
	var problems []string
	for _, r := range slices.Backward(m.pending) {
		if r.typed {
			// messageLeftFor should have kept it from being posted.
			problems = append(problems, "a typed receive is pending with no message left for it: "+r.String())
			continue
		}
		problems = append(problems, m.finalCancel(r, "a receive left pending", r.req.Wait)...)
	}
	m.pending = nil
	for _, r := range slices.Backward(m.prepared) {
		problems = append(problems, m.finalCancel(r, "a prepared typed receive left", r.prep.Run)...)
	}
	m.prepared = nil
	return problems
}

// finalCancel ends r through wait (its Wait or Run) with an ended
// context; it must come out cancelled, since every message has been
// received.
func (m *matchReceiver) finalCancel(r *receiveRecord, what string, wait func(context.Context) (Status, error)) []string {
	r.cancelStep = m.step
	ended, cancel := endingAfter(context.Background(), 0)
	st, err := wait(ended)
	cancel()
	m.finish(r, st, err)
	m.logf("final cancel %v", r)
	if !r.cancelled {
		return []string{what + " after every message was received completed: " + r.String()}
	}
	return nil
}

// receivedMessage is a receive that got a message of a (source, tag), or
// one too large for it.
type receivedMessage struct {
	r   *receiveRecord
	idx int // the message's index in its (source, tag)'s order; -1 when truncated
}

// check checks the records against MPI's matching rules. When the run
// ended early (finished false), receives still pending and messages not
// yet received are not problems, and the order is not checked: a pending
// receive may have taken a message the harness has not seen yet.
func (m *matchReceiver) check(finished bool) []string {
	var problems []string
	bad := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }

	// Each (source, tag)'s receives that got a message, in post order.
	byKey := map[matchKey][]receivedMessage{}
	for _, r := range m.records {
		switch {
		case !r.done:
			if finished {
				bad("never completed: %v", r)
			}
			continue
		case r.cancelled:
			continue
		case r.truncSize != 0:
			if r.src != AnySource && r.truncSrc != r.src {
				bad("truncated by a message from the wrong source: %v", r)
			}
			if r.truncSize <= r.bufLen {
				bad("truncated, but the message fits: %v", r)
			}
			if r.probeCall != "" && r.probeSize != r.truncSize {
				bad("%s reported %d B for the message that then truncated %v", r.probeCall, r.probeSize, r)
			}
			k := matchKey{r.truncSrc, r.tag}
			byKey[k] = append(byKey[k], receivedMessage{r, -1})
			continue
		case r.err != nil:
			bad("failed: %v", r)
			continue
		}
		d := r.data
		if len(d) < 8 || d[6] != 0xA5 || d[7] != 0x5A {
			bad("malformed payload of %d B: %v", len(d), r)
			continue
		}
		src, tag, idx := int(d[0]), int(d[1]), int(binary.LittleEndian.Uint32(d[2:]))
		k := matchKey{src, tag}
		switch {
		case tag != r.tag || r.src != AnySource && src != r.src:
			bad("got a message it does not match: %v", r)
			continue
		case r.status.Source != src || r.status.Tag != tag:
			bad("status %+v does not name the message it got: %v", r.status, r)
			continue
		case idx >= len(m.sizes[k]) || m.sizes[k][idx] != len(d):
			bad("got a message of the wrong size: %v", r)
			continue
		case !bytes.Equal(d, matchPayload(src, tag, idx, len(d))):
			bad("got a corrupted message: %v", r)
		}
		if r.probeCall != "" && r.probeSize != len(d) {
			bad("%s reported %d B for the message %v", r.probeCall, r.probeSize, r)
		}
		byKey[k] = append(byKey[k], receivedMessage{r, idx})
	}

	for src := 1; src <= matchSenders; src++ {
		for tag := range matchTags {
			k := matchKey{src, tag}
			sizes, got := m.sizes[k], byKey[k]
			times := map[int]int{}
			for pos, g := range got {
				if g.idx < 0 {
					if finished && pos < len(sizes) && g.r.truncSize != sizes[pos] && !m.departed[k] {
						bad("(src %d, tag %d): receive #%d, at position %d in post order, was truncated by a message of %d B, but message idx %d is of %d B; received in post order: %s",
							src, tag, g.r.id, pos, g.r.truncSize, pos, sizes[pos], receivedOrder(got))
					}
					continue
				}
				if times[g.idx]++; times[g.idx] == 2 {
					bad("(src %d, tag %d): message idx %d received more than once; received in post order: %s", src, tag, g.idx, receivedOrder(got))
				}
				if finished && g.idx != pos && !m.departed[k] {
					bad("(src %d, tag %d): receive #%d, at position %d in post order, got message idx %d; received in post order: %s",
						src, tag, g.r.id, pos, g.idx, receivedOrder(got))
				}
			}
			if finished && len(got) != len(sizes) {
				bad("(src %d, tag %d): %d messages sent, %d received; received in post order: %s", src, tag, len(sizes), len(got), receivedOrder(got))
			}
		}
	}

	// A receive cancelled after a receive posted after it took a message
	// it could match was pending when that message came.
	for _, early := range m.records {
		if !early.cancelled {
			continue
		}
		for _, late := range m.records[early.id+1:] {
			if !late.done || late.cancelled || late.tag != early.tag {
				continue
			}
			src := late.status.Source
			switch {
			case late.truncSize != 0:
				src = late.truncSrc
			case late.err != nil:
				continue
			}
			taken := late.doneStep
			if late.msg != nil || late.typedMsg != nil {
				taken = late.postStep // a matched probe took its message when it matched
			}
			if taken < early.cancelStep && (early.src == AnySource || early.src == src) && !m.departed[matchKey{src, early.tag}] {
				bad("%v was cancelled after the later %v had taken a message it could match", early, late)
			}
		}
	}
	return problems
}

// receivedOrder lists the message indices receives got, as idx(#record);
// T(#record) is a truncated receive.
func receivedOrder(got []receivedMessage) string {
	var parts []string
	for _, g := range got {
		if g.idx < 0 {
			parts = append(parts, fmt.Sprintf("T(#%d)", g.r.id))
		} else {
			parts = append(parts, fmt.Sprintf("%d(#%d)", g.idx, g.r.id))
		}
	}
	return strings.Join(parts, " ")
}

// report is the failure message of a run: the problems, the first few in
// full, and the end of the log.
func (m *matchReceiver) report(c matchConfig, seed int64, problems []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d, %s: %d problem(s)", seed, c, len(problems))
	for i, p := range problems {
		if i == matchReportProblems {
			fmt.Fprintf(&b, "\n... and %d more", len(problems)-i)
			break
		}
		b.WriteString("\n" + p)
	}
	log := m.log[max(0, len(m.log)-matchReportLines):]
	fmt.Fprintf(&b, "\nlast %d of %d log lines (step: call and outcome):", len(log), len(m.log))
	for _, l := range log {
		b.WriteString("\n  " + l)
	}
	fmt.Fprintf(&b, "\nagain: TROUPE_MATCH_SEEDS=%d go test ./transport -run 'TestRandomMatching/^%s$' -count=10", seed, c)
	return b.String()
}
