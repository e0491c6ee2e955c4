// Package bench measures protoactor-go's own gRPC remote (package
// github.com/asynkron/protoactor-go/remote) between two processes, so that
// troupe's actor runtime can be compared with it in one run.
//
// One process runs a Server (an echo actor and a counting actor behind a
// protoactor remote); the other calls Run, which measures
//
//   - rtt: request/response round trips from the client's root context to the
//     remote echo actor (mean and median microseconds), and
//   - tput: one-way throughput: the client sends N messages to the remote
//     counting actor, which replies once when it has received all N.
//
// Messages are protobuf, as protoactor's remote requires: payloads are
// wrapperspb.BytesValue, and the "expect N" / "got N" control messages are
// wrapperspb.Int64Value, so no code generation is needed.
package bench

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/asynkron/protoactor-go/actor"
	"github.com/asynkron/protoactor-go/remote"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Impl is the value of Row.Impl for every row this package produces.
const Impl = "protoactor-grpc"

// Names of the actors the server spawns.
const (
	EchoName    = "echo"
	CounterName = "counter"
)

// ServerMaxRecvMsgSize is the gRPC receive limit the server sets, so that a
// batch of large messages (see Config.MaxBatchBytes) fits in one gRPC message.
const ServerMaxRecvMsgSize = 64 << 20

// Row is one measurement. Test is "rtt" or "tput".
type Row struct {
	Impl string
	Test string
	Size int
	// Count is the number of round trips (rtt) or messages (tput) measured.
	Count int
	// US is the mean round trip in microseconds (rtt only).
	US float64
	// MedianUS is the median round trip in microseconds (rtt only; not in JSON).
	MedianUS float64
	// MsgsPerS is messages per second (tput only).
	MsgsPerS float64
	// MBps is payload megabytes (10^6 bytes) per second (tput only).
	MBps float64
}

type rttJSON struct {
	Impl string  `json:"impl"`
	Test string  `json:"test"`
	Size int     `json:"size"`
	US   float64 `json:"us"`
}

type tputJSON struct {
	Impl     string  `json:"impl"`
	Test     string  `json:"test"`
	Size     int     `json:"size"`
	MsgsPerS float64 `json:"msgs_per_s"`
	MBps     float64 `json:"MBps"`
}

// MarshalJSON writes {"impl","test","size","us"} for rtt rows and
// {"impl","test","size","msgs_per_s","MBps"} for tput rows.
func (r Row) MarshalJSON() ([]byte, error) {
	if r.Test == "rtt" {
		return json.Marshal(rttJSON{Impl: r.Impl, Test: r.Test, Size: r.Size, US: round2(r.US)})
	}
	return json.Marshal(tputJSON{Impl: r.Impl, Test: r.Test, Size: r.Size, MsgsPerS: round2(r.MsgsPerS), MBps: round2(r.MBps)})
}

func round2(v float64) float64 {
	f, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'f', 2, 64), 64)
	return f
}

// quietLogger is the actor systems' logger: protoactor logs connection
// setup and teardown at info level, which would mix with the results.
func quietLogger(verbose bool) func(*actor.ActorSystem) *slog.Logger {
	return func(*actor.ActorSystem) *slog.Logger {
		if verbose {
			return slog.Default()
		}
		return slog.New(slog.DiscardHandler)
	}
}

// startRemote creates an actor system with a started remote listening on
// host:port. remote.Start panics when it cannot listen; that is returned as
// an error.
func startRemote(host string, port int, verbose bool, opts ...remote.ConfigOption) (sys *actor.ActorSystem, r *remote.Remote, err error) {
	sys = actor.NewActorSystem(actor.WithLoggerFactory(quietLogger(verbose)))
	r = remote.NewRemote(sys, remote.Configure(host, port, opts...))
	defer func() {
		if p := recover(); p != nil {
			sys.Shutdown()
			sys, r, err = nil, nil, fmt.Errorf("start protoactor remote on %s: %v", net.JoinHostPort(host, strconv.Itoa(port)), p)
		}
	}()
	r.Start()
	return sys, r, nil
}

func splitAddr(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("parse address %q: %w", addr, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("parse port of %q: %w", addr, err)
	}
	return host, port, nil
}

// echoActor answers every BytesValue with the same message.
type echoActor struct{}

func (echoActor) Receive(ctx actor.Context) {
	if m, ok := ctx.Message().(*wrapperspb.BytesValue); ok {
		ctx.Respond(m)
	}
}

// counterActor counts BytesValue messages. An Int64Value{N} starts a round:
// the actor remembers its sender and replies Int64Value{N} to it once N
// payload messages have arrived.
type counterActor struct {
	expect  int64
	got     int64
	replyTo *actor.PID
}

func (c *counterActor) Receive(ctx actor.Context) {
	switch m := ctx.Message().(type) {
	case *wrapperspb.Int64Value:
		c.expect, c.got, c.replyTo = m.Value, 0, ctx.Sender()
		c.maybeReply(ctx)
	case *wrapperspb.BytesValue:
		c.got++
		c.maybeReply(ctx)
	}
}

func (c *counterActor) maybeReply(ctx actor.Context) {
	if c.replyTo != nil && c.got >= c.expect {
		ctx.Send(c.replyTo, &wrapperspb.Int64Value{Value: c.got})
		c.replyTo = nil
	}
}

// Server is the remote side of the benchmark: an actor system with a
// protoactor remote and the echo and counter actors.
type Server struct {
	system *actor.ActorSystem
	remote *remote.Remote
}

// StartServer starts a server listening on addr (host:port; port 0 picks a
// free port, see Addr).
func StartServer(addr string, verbose bool) (*Server, error) {
	host, port, err := splitAddr(addr)
	if err != nil {
		return nil, err
	}
	sys, r, err := startRemote(host, port, verbose,
		remote.WithServerOptions(grpc.MaxRecvMsgSize(ServerMaxRecvMsgSize)))
	if err != nil {
		return nil, err
	}
	s := &Server{system: sys, remote: r}
	if _, err := sys.Root.SpawnNamed(actor.PropsFromProducer(func() actor.Actor { return echoActor{} }), EchoName); err != nil {
		s.Stop()
		return nil, fmt.Errorf("spawn echo actor: %w", err)
	}
	if _, err := sys.Root.SpawnNamed(actor.PropsFromProducer(func() actor.Actor { return &counterActor{} }), CounterName); err != nil {
		s.Stop()
		return nil, fmt.Errorf("spawn counter actor: %w", err)
	}
	return s, nil
}

// Addr is the address the server listens on, for Config.Server.
func (s *Server) Addr() string { return s.system.Address() }

// Stop stops the server's gRPC server and actor system (not gracefully:
// protoactor's graceful shutdown races with its endpoint teardown).
func (s *Server) Stop() {
	s.remote.Shutdown(false)
	s.system.Shutdown()
}

// Config sets what Run measures. DefaultConfig gives the standard run; a
// zero RTTIters skips rtt and an empty TputSizes skips tput.
type Config struct {
	// Server is the address of the server (Server.Addr).
	Server string
	// Host is the address the client's own remote listens on (responses
	// come back over a connection the server opens to it).
	Host string
	// RTTSize is the rtt payload in bytes.
	RTTSize int
	// RTTWarmup round trips are done, untimed, before RTTIters timed ones.
	RTTWarmup int
	RTTIters  int
	// TputSizes are the payload sizes of the throughput tests.
	TputSizes []int
	// A tput test sends TputBytes/size messages, clamped to
	// [TputMinMsgs, TputMaxMsgs], after an untimed round of a tenth of that.
	TputBytes   int64
	TputMinMsgs int
	TputMaxMsgs int
	// MaxBatchBytes caps the client's EndpointWriterBatchSize (protoactor's
	// default is 1000 messages) at MaxBatchBytes/size messages, so that one
	// gRPC message of a batch of large payloads stays well under the
	// server's ServerMaxRecvMsgSize.
	MaxBatchBytes int
	// Timeout bounds one round trip, one throughput round, and the wait
	// for the server to answer the first time.
	Timeout time.Duration
	// Verbose lets protoactor log to slog.Default.
	Verbose bool
}

// DefaultConfig is the standard run against server: 20,000 8 B round trips
// and throughput for 64 B, 64 KiB and 1 MiB messages.
func DefaultConfig(server string) Config {
	return Config{
		Server:        server,
		Host:          "127.0.0.1",
		RTTSize:       8,
		RTTWarmup:     2000,
		RTTIters:      20000,
		TputSizes:     []int{64, 64 << 10, 1 << 20},
		TputBytes:     512 << 20,
		TputMinMsgs:   100,
		TputMaxMsgs:   1000000,
		MaxBatchBytes: 4 << 20,
		Timeout:       2 * time.Minute,
	}
}

// TputCount is the number of messages a tput test of size bytes sends.
func (c Config) TputCount(size int) int {
	n := c.TputBytes / int64(size)
	if n < int64(c.TputMinMsgs) {
		n = int64(c.TputMinMsgs)
	}
	if n > int64(c.TputMaxMsgs) {
		n = int64(c.TputMaxMsgs)
	}
	if n < 1 {
		n = 1
	}
	return int(n)
}

// batchSize is the client's EndpointWriterBatchSize for payloads of size.
func (c Config) batchSize(size int) int {
	const overhead = 64 // envelope fields per message
	b := 1000
	if c.MaxBatchBytes > 0 {
		if m := c.MaxBatchBytes / (size + overhead); m < b {
			b = m
		}
	}
	if b < 1 {
		b = 1
	}
	return b
}

func (c Config) validate() error {
	if c.Server == "" {
		return fmt.Errorf("protobench config: no server address")
	}
	if c.RTTIters < 0 || c.RTTWarmup < 0 || c.RTTSize < 0 {
		return fmt.Errorf("protobench config: negative rtt setting")
	}
	for _, s := range c.TputSizes {
		if s <= 0 {
			return fmt.Errorf("protobench config: tput size %d must be positive", s)
		}
	}
	if c.Timeout <= 0 {
		return fmt.Errorf("protobench config: timeout must be positive")
	}
	return nil
}

// clientKey identifies a client remote: the host it listens on and its
// endpoint writer batch size.
type clientKey struct {
	host  string
	batch int
}

// clientSystems holds the client remotes, started once per process and
// key and reused by later Runs: protoactor's remote keeps process-wide
// gRPC state (Start sets grpclog's logger, Shutdown races with the
// endpoint writers' teardown), so it is not started and stopped per run.
var (
	clientMu      sync.Mutex
	clientSystems = map[clientKey]*actor.ActorSystem{}
)

func clientSystem(cfg Config, batch int) (*actor.ActorSystem, error) {
	clientMu.Lock()
	defer clientMu.Unlock()
	key := clientKey{host: cfg.Host, batch: batch}
	if sys, ok := clientSystems[key]; ok {
		return sys, nil
	}
	sys, _, err := startRemote(cfg.Host, 0, cfg.Verbose, remote.WithEndpointWriterBatchSize(batch))
	if err != nil {
		return nil, err
	}
	clientSystems[key] = sys
	return sys, nil
}

// client is a client actor system talking to one server.
type client struct {
	cfg     Config
	system  *actor.ActorSystem
	echo    *actor.PID
	counter *actor.PID
}

func newClient(cfg Config, batch int) (*client, error) {
	sys, err := clientSystem(cfg, batch)
	if err != nil {
		return nil, err
	}
	c := &client{
		cfg:     cfg,
		system:  sys,
		echo:    actor.NewPID(cfg.Server, EchoName),
		counter: actor.NewPID(cfg.Server, CounterName),
	}
	if err := c.waitServer(); err != nil {
		return nil, err
	}
	return c, nil
}

// waitServer sends echo requests until one is answered (the connections
// in both directions are set up by then) or cfg.Timeout has passed.
func (c *client) waitServer() error {
	deadline := time.Now().Add(c.cfg.Timeout)
	ping := &wrapperspb.BytesValue{Value: []byte("ping")}
	for {
		res, err := c.system.Root.RequestFuture(c.echo, ping, time.Second).Result()
		if err == nil {
			if _, ok := res.(*wrapperspb.BytesValue); ok {
				return nil
			}
			err = fmt.Errorf("unexpected reply %T", res)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer from protobench server at %s: %w", c.cfg.Server, err)
		}
	}
}

func (c *client) roundTrip(payload *wrapperspb.BytesValue) error {
	res, err := c.system.Root.RequestFuture(c.echo, payload, c.cfg.Timeout).Result()
	if err != nil {
		return fmt.Errorf("rtt request to %s: %w", c.echo, err)
	}
	m, ok := res.(*wrapperspb.BytesValue)
	if !ok {
		return fmt.Errorf("rtt: unexpected reply %T", res)
	}
	if len(m.Value) != len(payload.Value) {
		return fmt.Errorf("rtt: reply has %d bytes, sent %d", len(m.Value), len(payload.Value))
	}
	return nil
}

// tputRound sends n payloads to the counter and waits for its count.
func (c *client) tputRound(payload *wrapperspb.BytesValue, n int) (time.Duration, error) {
	root := c.system.Root
	start := time.Now()
	f := root.RequestFuture(c.counter, &wrapperspb.Int64Value{Value: int64(n)}, c.cfg.Timeout)
	for i := 0; i < n; i++ {
		root.Send(c.counter, payload)
	}
	res, err := f.Result()
	elapsed := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("tput %d x %d B: waiting for the counter: %w", n, len(payload.Value), err)
	}
	got, ok := res.(*wrapperspb.Int64Value)
	if !ok {
		return 0, fmt.Errorf("tput: unexpected reply %T", res)
	}
	if got.Value != int64(n) {
		return 0, fmt.Errorf("tput %d B: counter got %d messages, sent %d", len(payload.Value), got.Value, n)
	}
	return elapsed, nil
}

// Run measures against the server at cfg.Server and returns the rtt row
// (if cfg.RTTIters > 0) followed by one tput row per cfg.TputSizes entry.
//
// Each test needs a client remote whose endpoint writer batch size suits
// its payload (see Config.MaxBatchBytes); the remotes stay up for the
// process's lifetime and are shared by tests and Runs with the same batch
// size. Starting more than one protoactor remote in a process (a server
// and a client, or clients for small and large sizes) touches gRPC's
// global logger without synchronization, which the race detector reports;
// run the server in its own process (SpawnServer). Runs against one server
// must not overlap: the server has a single counting actor.
func Run(cfg Config) ([]Row, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	clients := map[int]*client{}
	clientFor := func(size int) (*client, error) {
		b := cfg.batchSize(size)
		if c, ok := clients[b]; ok {
			return c, nil
		}
		c, err := newClient(cfg, b)
		if err != nil {
			return nil, err
		}
		clients[b] = c
		return c, nil
	}

	var rows []Row
	if cfg.RTTIters > 0 {
		c, err := clientFor(cfg.RTTSize)
		if err != nil {
			return rows, err
		}
		row, err := runRTT(c)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row)
	}
	for _, size := range cfg.TputSizes {
		c, err := clientFor(size)
		if err != nil {
			return rows, err
		}
		row, err := runTput(c, size)
		if err != nil {
			return rows, err
		}
		rows = append(rows, row)
	}
	return rows, nil
}

func runRTT(c *client) (Row, error) {
	cfg := c.cfg
	payload := &wrapperspb.BytesValue{Value: make([]byte, cfg.RTTSize)}
	for i := 0; i < cfg.RTTWarmup; i++ {
		if err := c.roundTrip(payload); err != nil {
			return Row{}, err
		}
	}
	samples := make([]time.Duration, cfg.RTTIters)
	var total time.Duration
	for i := range samples {
		t0 := time.Now()
		if err := c.roundTrip(payload); err != nil {
			return Row{}, err
		}
		samples[i] = time.Since(t0)
		total += samples[i]
	}
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	median := samples[len(samples)/2]
	if len(samples)%2 == 0 {
		median = (samples[len(samples)/2-1] + samples[len(samples)/2]) / 2
	}
	return Row{
		Impl:     Impl,
		Test:     "rtt",
		Size:     cfg.RTTSize,
		Count:    cfg.RTTIters,
		US:       float64(total.Nanoseconds()) / float64(len(samples)) / 1e3,
		MedianUS: float64(median.Nanoseconds()) / 1e3,
	}, nil
}

func runTput(c *client, size int) (Row, error) {
	cfg := c.cfg
	payload := &wrapperspb.BytesValue{Value: make([]byte, size)}
	n := cfg.TputCount(size)
	warm := n / 10
	if warm < 1 {
		warm = 1
	}
	if _, err := c.tputRound(payload, warm); err != nil {
		return Row{}, fmt.Errorf("warm-up: %w", err)
	}
	elapsed, err := c.tputRound(payload, n)
	if err != nil {
		return Row{}, err
	}
	sec := elapsed.Seconds()
	return Row{
		Impl:     Impl,
		Test:     "tput",
		Size:     size,
		Count:    n,
		MsgsPerS: float64(n) / sec,
		MBps:     float64(n) * float64(size) / sec / 1e6,
	}, nil
}
