package transport

import "sync/atomic"

// TrafficStats counts the messages and bytes this rank moved through the
// tagged API and as active messages. Readable in-process with
// Transport.TrafficStats and exported as Prometheus metrics by
// transport/metrics.
//
// Tagged messages (Send, Isend, SendIOV, Sendrecv's halves, Recv, Irecv,
// matched receives: the USER tags of docs/transport.md) count once their
// request has completed without error, by its size: a send by its buffer's
// length, a receive by the message's. Typed (derived-datatype) transfers
// are counted by NoncontigStats, channel transfers by ChannelStats.
//
// Active messages count every message, the transport's own protocol
// messages (typed-transfer RTS and CTS, same-host descriptors and
// acknowledgements) and the actor runtime's included: a send once PostAM
// has accepted it or its SendAM request has completed, by header plus
// data; a receive when its handler is run, by header plus data, a bundle of
// coalesced messages (docs/transport.md) as the messages it carries.
type TrafficStats struct {
	TaggedSent, TaggedSentBytes         int64
	TaggedReceived, TaggedReceivedBytes int64
	AMSent, AMSentBytes                 int64
	AMReceived, AMReceivedBytes         int64
}

// traffic holds TrafficStats' counters, on cache lines of their own: the
// goroutines that complete requests and the one that delivers active
// messages write them, and nothing on the hot paths reads them.
type traffic struct {
	_                                   [64]byte
	taggedSent, taggedSentBytes         atomic.Int64
	taggedReceived, taggedReceivedBytes atomic.Int64
	amSent, amSentBytes                 atomic.Int64
	_                                   [64]byte
	amReceived, amReceivedBytes         atomic.Int64
	_                                   [64]byte
}

// TrafficStats returns a snapshot of this rank's traffic counters.
func (t *Transport) TrafficStats() TrafficStats {
	c := &t.traffic
	return TrafficStats{
		TaggedSent: c.taggedSent.Load(), TaggedSentBytes: c.taggedSentBytes.Load(),
		TaggedReceived: c.taggedReceived.Load(), TaggedReceivedBytes: c.taggedReceivedBytes.Load(),
		AMSent: c.amSent.Load(), AMSentBytes: c.amSentBytes.Load(),
		AMReceived: c.amReceived.Load(), AMReceivedBytes: c.amReceivedBytes.Load(),
	}
}

// countCompleted counts r, a request completing without error, if it is a
// tagged message or an active message's send.
func (c *traffic) countCompleted(r *Request) {
	switch r.op {
	case "send":
		c.taggedSent.Add(1)
		c.taggedSentBytes.Add(int64(r.bufLen))
	case "recv":
		c.taggedReceived.Add(1)
		c.taggedReceivedBytes.Add(int64(r.status.Size))
	case "am-send":
		c.amPosted(r.bufLen) // header and data (sendAM)
	}
}

// amPosted counts an active message of n bytes (header and data) sent.
func (c *traffic) amPosted(n int) {
	c.amSent.Add(1)
	c.amSentBytes.Add(int64(n))
}

// amDelivered counts msgs active messages of n bytes in all received.
func (c *traffic) amDelivered(msgs, n int) {
	c.amReceived.Add(int64(msgs))
	c.amReceivedBytes.Add(int64(n))
}
