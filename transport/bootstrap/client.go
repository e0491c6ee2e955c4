package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// Bootstrapper is what a rank uses to learn who it is and to exchange data at
// start-up. The rendezvous client (Dial, FromEnv) implements it; a PMIx
// implementation will later (see PMIx in env.go).
type Bootstrapper interface {
	// Rank is this process's rank in [0, Size()).
	Rank() int
	// Size is the number of ranks in the job.
	Size() int
	// AllGather publishes value under key for this rank and returns every
	// rank's value, indexed by rank. It is collective: it returns when all
	// ranks have called it with the same key. Keys may be reused once the
	// previous collective of that key has completed. Empty values come back
	// as nil.
	AllGather(ctx context.Context, key string, value []byte) ([][]byte, error)
	// Barrier returns when every rank has entered the barrier of that name.
	Barrier(ctx context.Context, name string) error
	// Close leaves the job. Collectives still pending at other ranks fail.
	Close() error
}

// LossNotifier is implemented by a Bootstrapper that learns when a rank of
// the job is lost, whether or not this rank ever talked to it. The
// rendezvous client does: the server tells every connected rank when
// another rank's connection ends without a goodbye (its process died) or,
// under the launcher, when its process exits before it said goodbye
// (docs/launcher.md, "Lost ranks"). A rank that closed its Bootstrapper in
// order (Close) has left, and is not reported.
type LossNotifier interface {
	// NotifyLost has fn called once for every rank lost while the
	// Bootstrapper is open, those lost before the call included (on the
	// caller's goroutine, before NotifyLost returns). Later losses are
	// reported on the Bootstrapper's reading goroutine, which reads
	// nothing else meanwhile: fn must not block, nor call the
	// Bootstrapper's collectives.
	NotifyLost(fn func(rank int, reason string))
}

// ErrClosed is returned by collectives on a closed Bootstrapper.
var ErrClosed = errors.New("bootstrap: closed")

// RankLostError is returned by a collective that could not complete because
// a rank disconnected (crashed, or closed) before contributing to it.
type RankLostError struct {
	Rank       int    // the rank that disconnected
	Collective string // the collective's name, as passed to AllGather or Barrier
}

func (e *RankLostError) Error() string {
	return fmt.Sprintf("bootstrap: rank %d disconnected before collective %q completed", e.Rank, e.Collective)
}

const (
	keyAllGather = "allgather/"
	keyBarrier   = "barrier/"
)

// client is the rendezvous implementation of Bootstrapper.
type client struct {
	conn       net.Conn
	addr       string
	rank, size int

	wmu sync.Mutex // serialises writes

	mu      sync.Mutex
	pending map[string]chan *frame
	err     error // terminal: set once the connection is unusable
	lost    []lostNotice
	onLost  []func(rank int, reason string)

	closeOnce sync.Once
	closing   chan struct{}
	done      chan struct{} // reader exited
}

// Dial joins the rendezvous at addr as rank of a job of size ranks, proving
// membership with token. It is what FromEnv uses, and what tests use to run
// several ranks in one binary. ctx bounds the connection and the join.
func Dial(ctx context.Context, addr string, token Token, rank, size int) (Bootstrapper, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("bootstrap: rank %d: cannot reach rendezvous %s: %w", rank, addr, err)
	}
	// Bound the handshake by ctx: when it ends, the pending I/O times out.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	reply, err := handshake(conn, token, rank, size)
	if !stop() || ctx.Err() != nil {
		conn.Close()
		return nil, fmt.Errorf("bootstrap: rank %d: joining rendezvous %s: %w", rank, addr, ctx.Err())
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("bootstrap: rank %d: joining rendezvous %s: %w", rank, addr, err)
	}
	if reply.Op == opError {
		conn.Close()
		return nil, fmt.Errorf("bootstrap: rank %d: rendezvous %s: %s", rank, addr, reply.Error)
	}
	if reply.Op != opOK {
		conn.Close()
		return nil, fmt.Errorf("bootstrap: rank %d: rendezvous %s: unexpected %q reply to join", rank, addr, reply.Op)
	}
	conn.SetDeadline(time.Time{})
	c := &client{
		conn:    conn,
		addr:    addr,
		rank:    rank,
		size:    size,
		pending: make(map[string]chan *frame),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}
	go c.readLoop()
	return c, nil
}

// lostNotice is a rank the server reported lost.
type lostNotice struct {
	rank   int
	reason string
}

func handshake(conn net.Conn, token Token, rank, size int) (*frame, error) {
	b, err := encodeFrame(&frame{Op: opJoin, Version: protocolVersion, Token: token.String(), Rank: rank, Size: size, Notify: true})
	if err != nil {
		return nil, err
	}
	if _, err := conn.Write(b); err != nil {
		return nil, err
	}
	return readFrame(conn)
}

func (c *client) Rank() int { return c.rank }
func (c *client) Size() int { return c.size }

func (c *client) readLoop() {
	defer close(c.done)
	for {
		f, err := readFrame(c.conn)
		if err != nil {
			select {
			case <-c.closing:
				err = ErrClosed
			default:
				err = fmt.Errorf("bootstrap: rank %d: lost connection to rendezvous %s: %w", c.rank, c.addr, err)
			}
			c.fail(err)
			return
		}
		if f.Op == opLost {
			if f.Lost == nil || *f.Lost < 0 || *f.Lost >= c.size || *f.Lost == c.rank {
				c.fail(fmt.Errorf("bootstrap: rank %d: protocol error: lost notice without a valid rank from rendezvous", c.rank))
				c.conn.Close()
				return
			}
			c.rankLost(*f.Lost, f.Error)
			continue
		}
		if f.Op != opResult && f.Op != opError {
			c.fail(fmt.Errorf("bootstrap: rank %d: protocol error: unexpected %q frame from rendezvous", c.rank, f.Op))
			c.conn.Close()
			return
		}
		c.mu.Lock()
		ch := c.pending[f.Key]
		delete(c.pending, f.Key)
		c.mu.Unlock()
		if ch != nil {
			ch <- f // buffered, never blocks
		}
	}
}

// rankLost records a lost rank and tells the subscribers (readLoop).
func (c *client) rankLost(rank int, reason string) {
	c.mu.Lock()
	for _, l := range c.lost {
		if l.rank == rank {
			c.mu.Unlock()
			return
		}
	}
	c.lost = append(c.lost, lostNotice{rank, reason})
	fns := c.onLost
	c.mu.Unlock()
	for _, fn := range fns {
		fn(rank, reason)
	}
}

// NotifyLost implements LossNotifier.
func (c *client) NotifyLost(fn func(rank int, reason string)) {
	c.mu.Lock()
	earlier := c.lost // append-only: the prefix stays as it is
	c.onLost = append(c.onLost, fn)
	c.mu.Unlock()
	for _, l := range earlier {
		fn(l.rank, l.reason)
	}
}

// fail makes the connection unusable and wakes every pending collective.
func (c *client) fail(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = err
	}
	for k, ch := range c.pending {
		delete(c.pending, k)
		close(ch)
	}
}

func (c *client) AllGather(ctx context.Context, key string, value []byte) ([][]byte, error) {
	return c.collective(ctx, "allgather", key, keyAllGather+key, value)
}

func (c *client) Barrier(ctx context.Context, name string) error {
	_, err := c.collective(ctx, "barrier", name, keyBarrier+name, nil)
	return err
}

func (c *client) collective(ctx context.Context, kind, name, key string, value []byte) ([][]byte, error) {
	b, err := encodeFrame(&frame{Op: opGather, Rank: c.rank, Key: key, Value: value})
	if err != nil {
		return nil, fmt.Errorf("bootstrap: %s %q: %w", kind, name, err)
	}
	if err := ctx.Err(); err != nil {
		// Nothing sent: the connection stays good.
		return nil, fmt.Errorf("bootstrap: rank %d: %s %q: %w", c.rank, kind, name, err)
	}
	ch := make(chan *frame, 1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return nil, err
	}
	if _, busy := c.pending[key]; busy {
		c.mu.Unlock()
		return nil, fmt.Errorf("bootstrap: %s %q already in progress on rank %d", kind, name, c.rank)
	}
	c.pending[key] = ch
	c.mu.Unlock()

	c.wmu.Lock()
	if dl, ok := ctx.Deadline(); ok {
		c.conn.SetWriteDeadline(dl)
	} else {
		c.conn.SetWriteDeadline(time.Time{})
	}
	n, err := c.conn.Write(b)
	c.wmu.Unlock()
	if err != nil && n == 0 && ctx.Err() != nil {
		// The deadline came before a byte left: the stream is intact, and
		// the rank stays in the job (closing it would have the rendezvous
		// report it lost to every other rank).
		c.mu.Lock()
		delete(c.pending, key)
		c.mu.Unlock()
		return nil, fmt.Errorf("bootstrap: rank %d: %s %q: %w", c.rank, kind, name, ctx.Err())
	}
	if err != nil {
		// A partial frame corrupts the stream: the connection is finished.
		err = fmt.Errorf("bootstrap: rank %d: %s %q: sending to rendezvous: %w", c.rank, kind, name, err)
		c.fail(err)
		c.conn.Close()
		return nil, err
	}

	select {
	case f, ok := <-ch:
		if !ok {
			c.mu.Lock()
			err := c.err
			c.mu.Unlock()
			return nil, err
		}
		if f.Op == opError {
			if f.Lost != nil {
				return nil, &RankLostError{Rank: *f.Lost, Collective: name}
			}
			return nil, fmt.Errorf("bootstrap: rank %d: %s %q: %s", c.rank, kind, name, f.Error)
		}
		if len(f.Values) != c.size {
			return nil, fmt.Errorf("bootstrap: rank %d: %s %q: got %d values for %d ranks", c.rank, kind, name, len(f.Values), c.size)
		}
		return f.Values, nil
	case <-ctx.Done():
		c.mu.Lock()
		if c.pending[key] == ch {
			delete(c.pending, key)
		}
		c.mu.Unlock()
		return nil, fmt.Errorf("bootstrap: rank %d: %s %q: %w", c.rank, kind, name, ctx.Err())
	}
}

// byeWait bounds how long Close waits for the server to end the
// connection after the goodbye.
const byeWait = time.Second

func (c *client) Close() error {
	c.closeOnce.Do(func() {
		close(c.closing)
		if b, err := encodeFrame(&frame{Op: opBye, Rank: c.rank}); err == nil {
			c.wmu.Lock()
			c.conn.SetWriteDeadline(time.Now().Add(time.Second))
			_, err = c.conn.Write(b)
			c.wmu.Unlock()
			// Wait (at most byeWait) for the server to end the connection
			// after the goodbye, reading what it still sends (a loss
			// notice, say): a socket closed with unread data resets the
			// connection, and a reset can reach the server before it has
			// read the goodbye, which would then report this rank lost to
			// the others.
			if cw, ok := c.conn.(interface{ CloseWrite() error }); ok && err == nil && cw.CloseWrite() == nil {
				t := time.NewTimer(byeWait)
				select {
				case <-c.done:
				case <-t.C:
				}
				t.Stop()
			}
		}
		c.conn.Close()
	})
	<-c.done
	return nil
}
