package actor

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	pa "github.com/asynkron/protoactor-go/actor"
)

// Check reports whether msg can be sent to another rank: its type is
// registered and it encodes. Send, Request and friends call it for remote
// targets; protoactor's own Context.Send cannot return an error, so an
// unsendable message given to it goes to dead letters instead.
func Check(msg any) error {
	ct, _, err := lookupType(msg)
	if err != nil {
		return err
	}
	if msg, err = checkDeviceTyped(ct, msg); err != nil {
		return err
	}
	_, _, err = encodeBody(ct, msg)
	return err
}

// ErrNotInJob reports a message to a PID whose address names no rank of
// this job (a rank beyond the job's size, or no troupe rank at all): it
// could only reach the dead letters.
var ErrNotInJob = errors.New("actor: PID names no rank of this job")

// ErrFieldsTooLarge reports a message to another rank with a Payload, Typed
// or gpu.Buffer field whose other fields encode to more than the transport
// carries beside it: those fields travel in the active message's header
// (at most transport.Transport.MaxAMHeader bytes with the envelope, about
// 8 KiB), the data part being the payload's. Put large data in the payload.
var ErrFieldsTooLarge = errors.New("actor: message fields too large to travel beside its payload")

// protoLocal is the address protoactor gives PIDs of its own process
// before a system address is set; its registry treats it as local.
const protoLocal = "nonhost"

// checkTarget refuses a nil PID and one naming no rank of this job.
func (rt *Runtime) checkTarget(pid *pa.PID, op string) error {
	if pid == nil {
		return fmt.Errorf("actor: %s to a nil PID", op)
	}
	if pid.Address == rt.addrs[rt.rank] || pid.Address == protoLocal {
		return nil
	}
	if r, ok := rankOf(pid.Address); ok && r < rt.size {
		return nil
	}
	return fmt.Errorf("%w: %s to %s (a job of %d ranks)", ErrNotInJob, op, pid, rt.size)
}

// remote reports whether pid lives on another rank of this job.
func (rt *Runtime) remote(pid *pa.PID) (int, bool) {
	r := RankOf(pid)
	return r, r >= 0 && r < rt.size && r != rt.rank
}

// Send sends msg to pid from the root context. For a remote pid the
// message is encoded now, so an unregistered type fails here.
func (rt *Runtime) Send(pid *pa.PID, msg any) error {
	return rt.SendFrom(nil, pid, msg)
}

// SendFrom sends msg to pid as sender (nil: no sender); receivers see the
// sender through Context.Sender and may Respond to it.
func (rt *Runtime) SendFrom(sender *pa.PID, pid *pa.PID, msg any) error {
	if err := rt.checkTarget(pid, "send"); err != nil {
		return err
	}
	if rt.closed.Load() {
		return ErrClosed
	}
	if r, ok := rt.remote(pid); ok {
		return rt.send(r, pid, msg, sender, 0)
	}
	if msg == nil {
		// As a remote send does (lookupType): nothing would arrive.
		return fmt.Errorf("actor: send to %s: %w: nil message", pid, ErrUnregistered)
	}
	if sender == nil {
		rt.sys.Root.Send(pid, msg)
		return nil
	}
	rt.sys.Root.RequestWithCustomSender(pid, msg, sender)
	return nil
}

// SendDevice is SendFrom for a message with a gpu.Buffer field (the GPU
// Messaging API) that returns before the buffer may be reused, with a
// Completion that says when it may. A buffer of cuda device memory going
// to another process of this host (CUDA IPC: the receiver copies from the
// buffer itself) keeps the Completion pending until the receiver has
// copied, and one of PairDeviceMin bytes or more going to another rank
// otherwise until its pair channel send is done; a smaller one was staged
// before SendDevice returned, and a target on this rank receives the
// message as it is: the Completion is done at once. SendFrom is
// SendDevice followed by waiting for the Completion.
func (rt *Runtime) SendDevice(sender, pid *pa.PID, msg any) (*Completion, error) {
	var c *Completion
	var err error
	if r, ok := rt.remote(pid); ok { // remote(nil) is false
		c, err = rt.sendAsync(r, pid, msg, sender, 0)
	} else {
		err = rt.SendFrom(sender, pid, msg) // nil PID, closed runtime, local target
	}
	if err != nil || c != nil {
		return c, err
	}
	return completed(nil), nil
}

// RequestFuture sends msg to pid and returns a future for the response.
// Errors in sending (an unregistered type, a lost rank) are returned now.
func (rt *Runtime) RequestFuture(pid *pa.PID, msg any, timeout time.Duration) (*pa.Future, error) {
	if err := rt.checkTarget(pid, "request"); err != nil {
		return nil, err
	}
	if rt.closed.Load() {
		return nil, ErrClosed
	}
	f := pa.NewFuture(rt.sys, timeout)
	if r, ok := rt.remote(pid); ok {
		rt.trackRequest(f.PID().Id, r, nil)
		if err := rt.send(r, pid, msg, f.PID(), 0); err != nil {
			rt.answered(f.PID().Id)
			rt.sys.Root.Stop(f.PID())
			return nil, err
		}
		return f, nil
	}
	rt.sys.Root.RequestWithCustomSender(pid, msg, f.PID())
	return f, nil
}

// Request sends msg to pid and waits up to timeout for the response. A
// message the target rank could not deliver comes back as an
// *UndeliverableError; a request to an actor that does not exist fails at
// once with ErrNoActor; a request to a rank that is lost fails at once. An
// answer from another rank taken for it just as it timed out is returned.
// While it waits, the calling goroutine progresses the transport itself for
// a moment (as a blocking Recv does), so a quick answer costs no wake-up.
func (rt *Runtime) Request(pid *pa.PID, msg any, timeout time.Duration) (any, error) {
	if err := rt.checkTarget(pid, "request"); err != nil {
		return nil, err
	}
	if rt.closed.Load() {
		return nil, ErrClosed
	}
	rp := &replyProcess{done: make(chan struct{})}
	var self *pa.PID
	r, remote := rt.remote(pid)
	if remote {
		// The reply comes back through the runtime, which finds rp in its
		// request table (takeReply).
		self = pa.NewPID(rt.addrs[rt.rank], requestPrefix+strconv.FormatUint(rt.reqSeq.Add(1), 36))
		rt.trackRequest(self.Id, r, rp)
		if err := rt.send(r, pid, msg, self, 0); err != nil {
			rt.answered(self.Id)
			return nil, err
		}
	} else {
		var ok bool
		if self, ok = rt.sys.ProcessRegistry.Add(rp, "request"+rt.sys.ProcessRegistry.NextId()); !ok {
			return nil, errors.New("actor: request id in use")
		}
		defer rt.sys.ProcessRegistry.Remove(self)
		rt.sys.Root.RequestWithCustomSender(pid, msg, self)
	}
	if !rt.t.AwaitFor(rp.done, timeout) {
		if f := rt.requestTimedOut; f != nil && remote {
			f(rp)
		}
		if !remote || rt.answered(self.Id).reply != nil {
			return nil, fmt.Errorf("actor: request to %s: %w", pid, pa.ErrTimeout)
		}
		// Its answer was taken from the request table as it timed out,
		// and is being handed to rp (whoever takes a reply hands it one
		// at once): returned, for the caller to own (a device message's
		// runtime-allocated memory would otherwise be held for ever).
		<-rp.done
	}
	switch res := rp.result.(type) {
	case *pa.DeadLetterResponse:
		return nil, fmt.Errorf("%w: %s", ErrNoActor, pid)
	case *UndeliverableError:
		return nil, res
	default:
		return res, nil
	}
}

// replyProcess receives the one response to a Request.
type replyProcess struct {
	once   sync.Once
	done   chan struct{}
	result any
}

func (p *replyProcess) SendUserMessage(_ *pa.PID, message any) {
	p.once.Do(func() {
		_, p.result, _ = pa.UnwrapEnvelope(message)
		close(p.done)
	})
}

func (p *replyProcess) SendSystemMessage(_ *pa.PID, message any) {}

func (p *replyProcess) Stop(_ *pa.PID) {}

// Result waits for a future and turns runtime error responses into errors.
func Result(f *pa.Future) (any, error) {
	res, err := f.Result()
	if err != nil {
		if errors.Is(err, pa.ErrDeadLetter) {
			return nil, fmt.Errorf("%w (%w)", ErrNoActor, err)
		}
		return nil, err
	}
	if ue, ok := res.(*UndeliverableError); ok {
		return nil, ue
	}
	return res, nil
}

// ErrNoActor reports a request to an actor that does not exist.
var ErrNoActor = errors.New("actor: no such actor")
