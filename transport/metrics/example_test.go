package metrics_test

import (
	"fmt"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/troupe-hpc/troupe/transport/metrics"
)

// QueueStats is a program's own counters, kept in a struct as troupe's are.
type QueueStats struct {
	Enqueued atomic.Uint64 // a counter: troupe_queue_enqueued_total
	Depth    atomic.Int64  `metric:",gauge"` // a gauge: troupe_queue_depth
	Label    string        // not a number: left out
}

// A struct of counters becomes metrics with one Add; every scrape reads the
// struct anew.
func ExampleAdd() {
	var q QueueStats
	c := metrics.New(0)
	if err := metrics.Add(c, "queue", func() *QueueStats { return &q }); err != nil {
		fmt.Println(err)
		return
	}
	q.Enqueued.Add(3)
	q.Depth.Store(2)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, f := range fams {
		m := f.GetMetric()[0]
		v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
		fmt.Printf("%s %s %v\n", f.GetName(), f.GetType(), v)
	}
	// Output:
	// troupe_queue_depth GAUGE 2
	// troupe_queue_enqueued_total COUNTER 3
}
