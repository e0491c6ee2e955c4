package bootstrap

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
)

const (
	// joinTimeout bounds how long an accepted connection may take to send its join frame.
	joinTimeout = 30 * time.Second
	// writeTimeout bounds one write to a client; a client that stops reading is dropped.
	writeTimeout = 30 * time.Second
	// exitGoodbye bounds how long, once the launcher saw a rank's process
	// exit, the server waits for the end of that rank's connection
	// (normally there at once: the kernel closed the socket) before it
	// closes the connection itself and reports the rank lost, unless the
	// rank had said goodbye. A descendant that escaped the rank's process
	// group might otherwise hold the socket open.
	exitGoodbye = time.Second
)

// Server is the loopback rendezvous service run by the launcher (or by tests
// in-process). It admits exactly size ranks holding the job token and runs
// their collectives.
type Server struct {
	ln    net.Listener
	size  int
	token Token
	log   *zap.Logger

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{} // every open connection, joined or not
	peers  []*peer               // joined and still connected, indexed by rank
	joined []bool                // ranks that ever joined (a rank joins once)
	lost   int                   // first rank that disconnected, or -1
	colls  map[string]*collective
	wg     sync.WaitGroup
}

type peer struct {
	rank   int
	conn   net.Conn
	notify bool          // takes opLost notices (said so in its join)
	gone   chan struct{} // closed once drop has run and delivered its frames
	wmu    sync.Mutex
}

type collective struct {
	values [][]byte
	have   []bool
	n      int
}

// NewServer starts a rendezvous service for a job of size ranks on
// 127.0.0.1 with an ephemeral port (see Addr). log may be nil.
func NewServer(size int, token Token, log *zap.Logger) (*Server, error) {
	if size < 1 || size > MaxLocalRanks {
		return nil, fmt.Errorf("bootstrap: job size must be 1 to %d, got %d", MaxLocalRanks, size)
	}
	if token.IsZero() {
		return nil, errors.New("bootstrap: refusing to serve with the zero job token")
	}
	if log == nil {
		log = zap.NewNop()
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("bootstrap: rendezvous listen: %w", err)
	}
	s := &Server{
		ln:     ln,
		size:   size,
		token:  token,
		log:    log.Named("rendezvous"),
		conns:  make(map[net.Conn]struct{}),
		peers:  make([]*peer, size),
		joined: make([]bool, size),
		lost:   -1,
		colls:  make(map[string]*collective),
	}
	s.log.Debug("rendezvous listening", zap.String("addr", ln.Addr().String()), zap.Int("size", size))
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// Addr is the host:port ranks dial (the value of TROUPE_RDV).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops accepting, drops every connection (pending collectives fail at
// the clients with a lost connection) and waits for the server's goroutines.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	err := s.ln.Close()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	var backoff time.Duration
	for {
		c, err := s.ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, say (EMFILE): ranks still to join
			// would wait for ever if the loop ended. Try again after a
			// pause, as net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Error("rendezvous accept failed; retrying", zap.Error(err), zap.Duration("after", backoff))
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(c)
	}
}

func (s *Server) forget(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	c.Close()
}

// reject answers a failed join with the reason and logs it.
func (s *Server) reject(c net.Conn, reason string, fields ...zap.Field) {
	fields = append(fields, zap.String("remote", c.RemoteAddr().String()), zap.String("reason", reason))
	s.log.Warn("rendezvous join rejected", fields...)
	if b, err := encodeFrame(&frame{Op: opError, Error: "join rejected: " + reason}); err == nil {
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(b)
	}
}

func (s *Server) handle(c net.Conn) {
	defer s.wg.Done()
	defer s.forget(c)

	c.SetReadDeadline(time.Now().Add(joinTimeout))
	f, err := readFrameMax(c, maxJoinFrame)
	if err != nil {
		var nerr net.Error
		switch {
		case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.As(err, &nerr):
			s.log.Debug("rendezvous connection closed before join", zap.String("remote", c.RemoteAddr().String()), zap.Error(err))
		default: // too large, or not a frame the protocol knows
			s.reject(c, err.Error())
		}
		return
	}
	c.SetReadDeadline(time.Time{})
	p, ok := s.admit(c, f)
	if !ok {
		return
	}
	log := s.log.With(zap.Int("rank", p.rank))
	if !s.send(p, &frame{Op: opOK, Rank: p.rank, Size: s.size}) {
		s.drop(p, false, errors.New("could not acknowledge join"))
		return
	}
	log.Debug("rank joined")

	for {
		f, err := readFrame(c)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				err = errors.New("connection closed without goodbye")
			}
			s.drop(p, false, err)
			return
		}
		switch f.Op {
		case opGather:
			s.contribute(p, f.Key, f.Value)
		case opBye:
			s.drop(p, true, nil)
			return
		default:
			s.drop(p, false, fmt.Errorf("protocol error: unexpected %q frame", f.Op))
			return
		}
	}
}

// admit validates a join frame and registers the rank.
func (s *Server) admit(c net.Conn, f *frame) (*peer, bool) {
	if f.Op != opJoin {
		s.reject(c, fmt.Sprintf("expected a join frame, got %q", f.Op))
		return nil, false
	}
	if f.Version != protocolVersion {
		s.reject(c, fmt.Sprintf("protocol version %d, server speaks %d", f.Version, protocolVersion), zap.Int("rank", f.Rank))
		return nil, false
	}
	if f.Token == "" {
		s.reject(c, "missing job token", zap.Int("rank", f.Rank))
		return nil, false
	}
	tok, err := ParseToken(f.Token)
	if err != nil || !tok.equal(s.token) {
		s.reject(c, "wrong job token", zap.Int("rank", f.Rank))
		return nil, false
	}
	if f.Size != s.size {
		s.reject(c, fmt.Sprintf("job size mismatch: rank claims %d, job has %d", f.Size, s.size), zap.Int("rank", f.Rank))
		return nil, false
	}
	if f.Rank < 0 || f.Rank >= s.size {
		s.reject(c, fmt.Sprintf("rank %d out of range [0,%d)", f.Rank, s.size), zap.Int("rank", f.Rank))
		return nil, false
	}
	s.mu.Lock()
	if s.joined[f.Rank] {
		s.mu.Unlock()
		s.reject(c, fmt.Sprintf("rank %d already joined", f.Rank), zap.Int("rank", f.Rank))
		return nil, false
	}
	p := &peer{rank: f.Rank, conn: c, notify: f.Notify, gone: make(chan struct{})}
	s.joined[f.Rank] = true
	s.peers[f.Rank] = p
	s.mu.Unlock()
	return p, true
}

// send writes one frame to p; false if the client is gone.
func (s *Server) send(p *peer, f *frame) bool {
	b, err := encodeFrame(f)
	if err != nil {
		s.log.Error("rendezvous encode failed", zap.Int("rank", p.rank), zap.Error(err))
		return false
	}
	return s.write(p, b)
}

func (s *Server) write(p *peer, b []byte) bool {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := p.conn.Write(b); err != nil {
		s.log.Debug("rendezvous write failed", zap.Int("rank", p.rank), zap.Error(err))
		p.conn.Close() // the reader then drops the rank
		return false
	}
	return true
}

type outgoing struct {
	to []*peer
	b  []byte
}

func (o outgoing) deliver(s *Server) {
	for _, p := range o.to {
		s.write(p, o.b)
	}
}

func lostFrame(key string, rank int) *frame {
	r := rank
	return &frame{Op: opError, Key: key, Lost: &r,
		Error: fmt.Sprintf("rank %d disconnected before collective %q completed", rank, key)}
}

// contribute adds p's value to the collective key; the last contribution
// broadcasts the result.
func (s *Server) contribute(p *peer, key string, value []byte) {
	s.mu.Lock()
	if s.lost >= 0 {
		lost := s.lost
		s.mu.Unlock()
		s.send(p, lostFrame(key, lost))
		return
	}
	c := s.colls[key]
	if c == nil {
		c = &collective{values: make([][]byte, s.size), have: make([]bool, s.size)}
		s.colls[key] = c
	}
	if c.have[p.rank] {
		s.mu.Unlock()
		s.log.Warn("rank contributed twice to a collective", zap.Int("rank", p.rank), zap.String("key", key))
		s.send(p, &frame{Op: opError, Key: key, Error: fmt.Sprintf("rank %d already contributed to collective %q", p.rank, key)})
		return
	}
	c.have[p.rank] = true
	c.values[p.rank] = value
	c.n++
	n := c.n
	if n < s.size {
		s.mu.Unlock()
		s.log.Debug("collective contribution", zap.Int("rank", p.rank), zap.String("key", key), zap.Int("have", n))
		return
	}
	delete(s.colls, key)
	to := append([]*peer(nil), s.peers...)
	s.mu.Unlock()

	b, err := encodeFrame(&frame{Op: opResult, Key: key, Values: c.values})
	if err != nil {
		s.log.Warn("collective result too large", zap.String("key", key), zap.Error(err))
		b, _ = encodeFrame(&frame{Op: opError, Key: key, Error: fmt.Sprintf("collective %q: result exceeds %d bytes", key, MaxFrameSize)})
	}
	s.log.Debug("collective complete", zap.String("key", key))
	outgoing{to: to, b: b}.deliver(s)
}

// drop unregisters p and fails every pending collective, naming p's rank;
// unless p left in order (or the server is closing), every other connected
// rank is told that p's rank is lost.
func (s *Server) drop(p *peer, orderly bool, cause error) {
	defer close(p.gone)
	s.mu.Lock()
	if s.peers[p.rank] == p {
		s.peers[p.rank] = nil
	}
	out := s.failPendingLocked(p.rank)
	closed := s.closed
	var notice outgoing
	if !orderly && !closed {
		reason := "connection closed without goodbye"
		if cause != nil {
			reason = cause.Error()
		}
		notice = s.lostNoticeLocked(p.rank, reason)
	}
	s.mu.Unlock()

	log := s.log.With(zap.Int("rank", p.rank))
	switch {
	case orderly && len(out) == 0, closed:
		log.Debug("rank left")
	case orderly:
		log.Info("rank left during a collective", zap.Int("failed_collectives", len(out)))
	default:
		// Info, not Warn: the launcher reports dead ranks itself, and the
		// ranks that were waiting get a RankLostError.
		log.Info("rank lost", zap.Error(cause), zap.Int("failed_collectives", len(out)))
	}
	for _, o := range out {
		o.deliver(s)
	}
	notice.deliver(s)
}

// failPendingLocked records rank as lost and fails every pending collective,
// returning the error frames to deliver once s.mu is released.
func (s *Server) failPendingLocked(rank int) []outgoing {
	if s.lost < 0 {
		s.lost = rank
	}
	var out []outgoing
	for key, c := range s.colls {
		b, _ := encodeFrame(lostFrame(key, rank))
		o := outgoing{b: b}
		for r, have := range c.have {
			if have && s.peers[r] != nil {
				o.to = append(o.to, s.peers[r])
			}
		}
		out = append(out, o)
		delete(s.colls, key)
	}
	return out
}

// lostNoticeLocked returns the opLost notice for rank, addressed to every
// connected rank that takes notices.
func (s *Server) lostNoticeLocked(rank int, reason string) outgoing {
	r := rank
	b, _ := encodeFrame(&frame{Op: opLost, Lost: &r, Error: reason})
	o := outgoing{b: b}
	for _, p := range s.peers {
		if p != nil && p.notify && p.rank != rank {
			o.to = append(o.to, p)
		}
	}
	return o
}

// rankExited is called by the launcher when rank's process has exited,
// before it stops the other ranks; when it returns, the other ranks have
// been told if the rank is lost (their notices are written). A rank that
// never joined can no longer join, so the job's collectives fail now,
// naming it, instead of waiting for it forever. A rank that joined is
// dropped when its connection ends, normally at once (the kernel closed
// it); rankExited waits for that, at most exitGoodbye, and then ends the
// connection itself. A rank that said goodbye first is not lost.
func (s *Server) rankExited(rank int) {
	s.mu.Lock()
	if rank < 0 || rank >= s.size {
		s.mu.Unlock()
		return
	}
	if s.joined[rank] {
		p := s.peers[rank]
		s.mu.Unlock()
		if p != nil {
			s.awaitGone(p)
		}
		return
	}
	s.joined[rank] = true
	out := s.failPendingLocked(rank)
	var notice outgoing
	if !s.closed {
		notice = s.lostNoticeLocked(rank, "its process exited before it joined the job")
	}
	s.mu.Unlock()
	s.log.Info("rank exited without joining", zap.Int("rank", rank), zap.Int("failed_collectives", len(out)))
	for _, o := range out {
		o.deliver(s)
	}
	notice.deliver(s)
}

// awaitGone waits until p, whose process exited, has been dropped: at
// most exitGoodbye for its connection to end, then as long again once the
// server closed it.
func (s *Server) awaitGone(p *peer) {
	t := time.NewTimer(exitGoodbye)
	defer t.Stop()
	select {
	case <-p.gone:
		return
	case <-t.C:
	}
	s.log.Info("connection of an exited rank still open: closing it", zap.Int("rank", p.rank))
	p.conn.Close() // handle's read fails: the rank is dropped as lost
	t.Reset(exitGoodbye)
	select {
	case <-p.gone:
	case <-t.C:
	}
}
