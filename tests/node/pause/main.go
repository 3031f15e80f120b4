// Command pause is the pod sandbox's first process, built here because the usual sandbox
// image cannot be pulled: it holds the pod's namespaces, sleeps until SIGINT or SIGTERM (then
// exits 0), and reaps the orphans it inherits as PID 1 of a pod that shares its process
// namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
