// Package metrics exports the counters of a troupe rank as Prometheus
// metrics (DESIGN section 9): the transport's traffic, typed-transfer
// schemes and caches, any-source matching, same-host zero copy, channels,
// the overlap engine's decisions and, through actor.Runtime.Collector, the
// actor runtime's counters.
//
// A Collector turns snapshot functions that return plain Go structs (the
// transport's XxxStats types) into metrics, one per numeric or boolean
// field, so that the structs stay the one place where a counter is defined
// and documented. Serve puts collectors on an HTTP endpoint;
// TROUPE_METRICS_ADDR makes every rank of an actor program do so
// (docs/metrics.md).
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/model"

	"github.com/troupe-hpc/troupe/overlap"
	"github.com/troupe-hpc/troupe/transport"
)

// Namespace is the first part of every metric name.
const Namespace = "troupe"

// AddrEnv names the environment variable that makes each rank of an actor
// program serve its metrics (actor.Init): host:port, rank r listening on
// port+r (port 0: a port of the system's choosing for every rank).
const AddrEnv = "TROUPE_METRICS_ADDR"

// ErrField reports a snapshot type that cannot be exported.
var ErrField = errors.New("metrics: unexportable snapshot")

// Collector is a prometheus.Collector over snapshot functions of one rank.
// Every metric carries the label rank. Add sources before registering the
// Collector; it is safe for concurrent collection.
type Collector struct {
	rank    string
	sources []*source
	names   map[string]bool
}

// source is one snapshot function and the metrics of its fields.
type source struct {
	snap   func() reflect.Value
	fields []field
}

// field is one exported field of a snapshot struct, reached by index.
type field struct {
	index []int
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(reflect.Value) float64
}

// New returns an empty Collector for rank.
func New(rank int) *Collector {
	return &Collector{rank: strconv.Itoa(rank), names: map[string]bool{}}
}

// Add exports the fields of the struct that snapshot returns (a struct or
// a pointer to one, read at every collection) as metrics named
// troupe_<subsystem>_<field>. Field names are written in snake case
// (TaggedSentBytes: tagged_sent_bytes); nested structs add their field
// names (Sent.Pack: sent_pack). Integers and floats, and sync/atomic's
// integer types, are counters with the suffix _total unless tagged as
// gauges; booleans are gauges of 0 or 1; strings and other kinds are left
// out. A struct tag `metric:"name,gauge"` renames a field and makes it a
// gauge (either part may be empty); `metric:"-"` leaves it out. Fields of
// sync/atomic types need a pointer snapshot. Add fails on a name already
// taken, a name Prometheus does not accept (a subsystem with a dash, say)
// or a type it cannot export.
func Add[T any](c *Collector, subsystem string, snapshot func() T) error {
	typ := reflect.TypeFor[T]()
	ptr := typ.Kind() == reflect.Pointer
	st := typ
	if ptr {
		st = typ.Elem()
	}
	if st.Kind() != reflect.Struct {
		return fmt.Errorf("%w: %s is not a struct", ErrField, typ)
	}
	s := &source{snap: func() reflect.Value {
		v := reflect.ValueOf(snapshot())
		if ptr {
			if v.IsNil() {
				return reflect.Value{}
			}
			return v.Elem()
		}
		return v
	}}
	names := map[string]bool{}
	if err := c.fields(s, st, nil, subsystem, st.String(), ptr, names); err != nil {
		return err
	}
	for n := range names {
		if c.names[n] {
			return fmt.Errorf("%w: metric %s added twice", ErrField, n)
		}
	}
	for n := range names {
		c.names[n] = true
	}
	c.sources = append(c.sources, s)
	return nil
}

// fields appends the metrics of struct type st, reached from the snapshot
// by index, named prefix_<field> and described as help.<field>.
func (c *Collector) fields(s *source, st reflect.Type, index []int, prefix, help string, addressable bool, names map[string]bool) error {
	for i := range st.NumField() {
		f := st.Field(i)
		if !f.IsExported() {
			continue
		}
		name, gauge, skip := parseTag(f)
		if skip {
			continue
		}
		idx := append(append([]int(nil), index...), i)
		full := prefix + "_" + name
		fhelp := help + "." + f.Name
		value, kind, ok := valueOf(f.Type, gauge)
		if !ok {
			if f.Type.Kind() == reflect.Struct && !isAtomic(f.Type) {
				if err := c.fields(s, f.Type, idx, full, fhelp, addressable, names); err != nil {
					return err
				}
			}
			continue
		}
		if isAtomic(f.Type) && !addressable {
			return fmt.Errorf("%w: %s is a sync/atomic value: snapshot a pointer", ErrField, fhelp)
		}
		if kind == prometheus.CounterValue {
			full += "_total"
		}
		metric := Namespace + "_" + full
		if !model.IsValidMetricName(model.LabelValue(metric)) {
			return fmt.Errorf("%w: %s is not a valid metric name (subsystem or metric tag)", ErrField, metric)
		}
		if names[metric] {
			return fmt.Errorf("%w: metric %s added twice", ErrField, metric)
		}
		names[metric] = true
		s.fields = append(s.fields, field{
			index: idx,
			desc:  prometheus.NewDesc(metric, "troupe "+fhelp, nil, prometheus.Labels{"rank": c.rank}),
			kind:  kind,
			value: value,
		})
	}
	return nil
}

// parseTag reads f's metric tag: its metric name (snake case of the field
// name by default), whether it is a gauge, whether it is left out.
func parseTag(f reflect.StructField) (name string, gauge, skip bool) {
	tag := f.Tag.Get("metric")
	if tag == "-" {
		return "", false, true
	}
	name, opt, _ := strings.Cut(tag, ",")
	if name == "" {
		name = snake(f.Name)
	}
	return name, opt == "gauge", false
}

// snake writes a Go identifier in snake case, keeping acronyms together:
// AMSentBytes is am_sent_bytes, InUCX in_ucx.
func snake(s string) string {
	r := []rune(s)
	var b strings.Builder
	for i, c := range r {
		if unicode.IsUpper(c) && i > 0 {
			prevLower := unicode.IsLower(r[i-1]) || unicode.IsDigit(r[i-1])
			acronymEnd := unicode.IsUpper(r[i-1]) && i+1 < len(r) && unicode.IsLower(r[i+1])
			if prevLower || acronymEnd {
				b.WriteByte('_')
			}
		}
		b.WriteRune(unicode.ToLower(c))
	}
	return b.String()
}

var (
	atomicInt32  = reflect.TypeFor[atomic.Int32]()
	atomicInt64  = reflect.TypeFor[atomic.Int64]()
	atomicUint32 = reflect.TypeFor[atomic.Uint32]()
	atomicUint64 = reflect.TypeFor[atomic.Uint64]()
	atomicBool   = reflect.TypeFor[atomic.Bool]()
)

func isAtomic(t reflect.Type) bool {
	switch t {
	case atomicInt32, atomicInt64, atomicUint32, atomicUint64, atomicBool:
		return true
	}
	return false
}

// valueOf returns how to read a field of type t as a float, and its kind;
// ok is false for a type that is not a number or a boolean.
func valueOf(t reflect.Type, gauge bool) (value func(reflect.Value) float64, kind prometheus.ValueType, ok bool) {
	kind = prometheus.CounterValue
	if gauge {
		kind = prometheus.GaugeValue
	}
	switch t {
	case atomicInt32:
		return func(v reflect.Value) float64 { return float64(v.Addr().Interface().(*atomic.Int32).Load()) }, kind, true
	case atomicInt64:
		return func(v reflect.Value) float64 { return float64(v.Addr().Interface().(*atomic.Int64).Load()) }, kind, true
	case atomicUint32:
		return func(v reflect.Value) float64 { return float64(v.Addr().Interface().(*atomic.Uint32).Load()) }, kind, true
	case atomicUint64:
		return func(v reflect.Value) float64 { return float64(v.Addr().Interface().(*atomic.Uint64).Load()) }, kind, true
	case atomicBool:
		return func(v reflect.Value) float64 { return b2f(v.Addr().Interface().(*atomic.Bool).Load()) }, prometheus.GaugeValue, true
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return func(v reflect.Value) float64 { return float64(v.Int()) }, kind, true
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return func(v reflect.Value) float64 { return float64(v.Uint()) }, kind, true
	case reflect.Float32, reflect.Float64:
		return func(v reflect.Value) float64 { return v.Float() }, kind, true
	case reflect.Bool:
		return func(v reflect.Value) float64 { return b2f(v.Bool()) }, prometheus.GaugeValue, true
	}
	return nil, 0, false
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Describe sends the descriptions of every metric the Collector exports.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, s := range c.sources {
		for _, f := range s.fields {
			ch <- f.desc
		}
	}
}

// Collect takes a snapshot of every source and sends its metrics. A
// source whose snapshot is a nil pointer sends none.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.sources {
		v := s.snap()
		if !v.IsValid() {
			continue
		}
		for _, f := range s.fields {
			m, err := prometheus.NewConstMetric(f.desc, f.kind, f.value(v.FieldByIndex(f.index)))
			if err != nil {
				m = prometheus.NewInvalidMetric(f.desc, err)
			}
			ch <- m
		}
	}
}

// transportMisc gathers the transport's counters that are not kept in a
// struct of their own.
type transportMisc struct {
	// PostFailed: PostAM sends that failed after PostAM returned.
	PostFailed uint64
	// ForeignDropped: messages dropped because their tag named a rank
	// outside the job.
	ForeignDropped uint64
	// Bundles and BundledMessages: bundles of coalesced PostAM messages
	// sent, and the messages they carried.
	Bundles, BundledMessages int64
}

// NewTransport returns a Collector over t's counters, under these
// subsystems: traffic (TrafficStats), noncontig (NoncontigStats),
// regcache (RegCacheStats), any_source (AnySourceStats), cma
// (CMAStats), channel (ChannelStats), transport (PostFailed,
// ForeignDropped, CoalesceStats) and, when t runs the overlap engine,
// overlap (the engine's overlap.Stats) and overlap_table (OverlapTable).
func NewTransport(t *transport.Transport) (*Collector, error) {
	c := New(t.Rank())
	errs := []error{
		Add(c, "traffic", t.TrafficStats),
		Add(c, "noncontig", t.NoncontigStats),
		Add(c, "regcache", t.RegCacheStats),
		Add(c, "any_source", t.AnySourceStats),
		Add(c, "cma", t.CMAStats),
		Add(c, "channel", t.ChannelStats),
		Add(c, "transport", func() transportMisc {
			b, m := t.CoalesceStats()
			return transportMisc{PostFailed: t.PostFailed(), ForeignDropped: t.ForeignDropped(), Bundles: b, BundledMessages: m}
		}),
	}
	if _, on := t.OverlapStats(); on {
		errs = append(errs,
			Add(c, "overlap", func() *overlap.Stats {
				s, ok := t.OverlapStats()
				if !ok {
					return nil
				}
				return &s
			}),
			Add(c, "overlap_table", t.OverlapTable))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// RankAddr returns the address rank listens on for addr (host:port, as in
// AddrEnv): port+rank, or port 0 for every rank when port is 0.
func RankAddr(addr string, rank int) (string, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("metrics: address %q: %w", addr, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", fmt.Errorf("metrics: address %q: bad port %q", addr, p)
	}
	if port == 0 {
		return addr, nil
	}
	if port+rank > 65535 {
		return "", fmt.Errorf("metrics: address %q: rank %d would listen on port %d, above 65535", addr, rank, port+rank)
	}
	return net.JoinHostPort(host, strconv.Itoa(port+rank)), nil
}

// Server serves metrics over HTTP at /metrics.
type Server struct {
	ln   net.Listener
	srv  *http.Server
	done chan error

	closeOnce sync.Once
	closeErr  error
}

// Serve listens on addr (host:port; port 0 picks a free port) and serves
// the collectors, with Go's runtime and process collectors, at /metrics
// until Close.
func Serve(addr string, cs ...prometheus.Collector) (*Server, error) {
	reg := prometheus.NewRegistry()
	all := append([]prometheus.Collector{
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	}, cs...)
	for _, c := range all {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: %w", err)
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: nil}))
	s := &Server{ln: ln, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}, done: make(chan error, 1)}
	go func() { s.done <- s.srv.Serve(ln) }()
	return s, nil
}

// Addr is the address the server listens on (with the port chosen).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is the server's metrics URL.
func (s *Server) URL() string { return "http://" + s.Addr() + "/metrics" }

// Close stops the server, waiting up to a second for scrapes in progress.
// Later calls return the first one's result.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := s.srv.Shutdown(ctx)
		if serr := <-s.done; !errors.Is(serr, http.ErrServerClosed) && err == nil {
			err = serr
		}
		s.closeErr = err
	})
	return s.closeErr
}
