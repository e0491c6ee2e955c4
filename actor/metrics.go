package actor

import (
	"fmt"
	"os"

	"go.uber.org/zap"

	"github.com/troupe-hpc/troupe/transport/metrics"
)

// Collector returns a Prometheus collector of this rank's counters: the
// transport's (metrics.NewTransport) and the runtime's Stats, as
// troupe_actor_<field>_total. Register it with a registry of the
// program's own, or let Options.MetricsAddr serve it.
func (rt *Runtime) Collector() (*metrics.Collector, error) {
	c, err := metrics.NewTransport(rt.t)
	if err != nil {
		return nil, err
	}
	if err := metrics.Add(c, "actor", func() *Stats { return &rt.stats }); err != nil {
		return nil, err
	}
	return c, nil
}

// MetricsURL is the URL of the rank's metrics endpoint (Options.MetricsAddr),
// or "" when it serves none.
func (rt *Runtime) MetricsURL() string {
	if rt.metrics == nil {
		return ""
	}
	return rt.metrics.URL()
}

// serveMetrics starts the endpoint that addr (else metrics.AddrEnv) asks
// for, if any. Init calls it once every rank has started.
func (rt *Runtime) serveMetrics(addr string) error {
	if addr == "" {
		addr = os.Getenv(metrics.AddrEnv)
	}
	if addr == "" {
		return nil
	}
	at, err := metrics.RankAddr(addr, rt.rank)
	if err != nil {
		return fmt.Errorf("actor: %w", err)
	}
	c, err := rt.Collector()
	if err != nil {
		return fmt.Errorf("actor: %w", err)
	}
	if rt.metrics, err = metrics.Serve(at, c); err != nil {
		return fmt.Errorf("actor: rank %d: %w", rt.rank, err)
	}
	rt.log.Info("serving metrics", zap.String("url", rt.metrics.URL()))
	return nil
}

// closeMetrics stops the metrics endpoint, if there is one.
func (rt *Runtime) closeMetrics() error {
	if rt.metrics == nil {
		return nil
	}
	return rt.metrics.Close()
}
