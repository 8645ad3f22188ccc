// Command controlplane is test infrastructure only: one multi-call binary that runs Kubernetes'
// own etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubelet and kubectl (plus a test device plugin and a test DRA kubelet plugin), picked
// by its first argument, so the
// Rust test suite can talk to a real control plane. Building them as one binary compiles the
// shared dependencies once and keeps their global flags and metrics registries apart (only the
// chosen command ever runs in a process).
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	kubectl "k8s.io/kubectl/pkg/cmd"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

const usage = "usage: controlplane etcd|apiserver|scheduler|controller-manager|kubelet|kubectl|deviceplugin|draplugin [flags...]"

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	component, rest := os.Args[1], os.Args[2:]
	if os.Getenv("CONTROLPLANE_EXIT_WITH_PARENT") != "" {
		go exitWithParent()
	}
	switch component {
	case "etcd":
		// etcdmain parses os.Args itself, program name first.
		etcdmain.Main(append([]string{"etcd"}, rest...))
	case "apiserver":
		cmd := apiserver.NewAPIServerCommand()
		cmd.SetArgs(rest)
		os.Exit(cli.Run(cmd))
	case "scheduler":
		cmd := scheduler.NewSchedulerCommand()
		cmd.SetArgs(rest)
		os.Exit(cli.Run(cmd))
	case "controller-manager":
		cmd := controllermanager.NewControllerManagerCommand()
		cmd.SetArgs(rest)
		os.Exit(cli.Run(cmd))
	case "kubelet":
		cmd := kubelet.NewKubeletCommand(context.Background())
		cmd.SetArgs(rest)
		os.Exit(cli.Run(cmd))
	case "deviceplugin":
		// A test device plugin (deviceplugin.go), not a Kubernetes component.
		os.Exit(runDevicePlugin(rest))
	case "draplugin":
		// A test DRA kubelet plugin in DraNet's format (draplugin.go), not a Kubernetes component.
		os.Exit(runDRAPlugin(rest))
	case "kubectl":
		cmd := kubectl.NewDefaultKubectlCommand()
		cmd.SetArgs(rest)
		os.Exit(cli.Run(cmd))
	default:
		fmt.Fprintf(os.Stderr, "controlplane: unknown component %q\n%s\n", component, usage)
		os.Exit(2)
	}
}

// exitWithParent ends this process once the process that started it is gone (it is then
// re-parented), so a test binary that exits or is killed never leaves a control plane behind.
func exitWithParent() {
	parent := os.Getppid()
	for range time.Tick(500 * time.Millisecond) {
		if os.Getppid() != parent {
			os.Exit(1)
		}
	}
}
