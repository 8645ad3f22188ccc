package main

// A minimal Kubernetes device plugin (k8s.io/kubelet deviceplugin v1beta1) for the node tests
// (tests/node.rs): it advertises N devices of one extended resource (by default
// rdma/hca_shared_devices_a, the name the Mellanox RDMA shared device plugin uses), re-registers
// when the kubelet restarts, and toggles all its devices between Healthy and Unhealthy on
// SIGUSR1, so a test can make a real kubelet see a dead plugin (kill it), sick devices (signal
// it) and a restarted kubelet. Test infrastructure only.

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type devicePlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	resource string
	devices  int
	mounts   []*pluginapi.Mount // handed to every container that gets a device

	mu      sync.Mutex
	healthy bool
	changed chan struct{} // closed and replaced on every health change
}

func (p *devicePlugin) list() ([]*pluginapi.Device, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	health := pluginapi.Healthy
	if !p.healthy {
		health = pluginapi.Unhealthy
	}
	devs := make([]*pluginapi.Device, 0, p.devices)
	for i := 0; i < p.devices; i++ {
		devs = append(devs, &pluginapi.Device{ID: fmt.Sprintf("hca-%d", i), Health: health})
	}
	return devs, p.changed
}

func (p *devicePlugin) toggle() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.healthy = !p.healthy
	close(p.changed)
	p.changed = make(chan struct{})
	return p.healthy
}

func (p *devicePlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *devicePlugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	for {
		devs, changed := p.list()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
			logf("ListAndWatch send: %v", err)
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			logf("ListAndWatch closed by kubelet")
			return nil
		}
	}
}

func (p *devicePlugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		logf("Allocate %v", c.DevicesIds)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs:   map[string]string{"FG_RDMA_DEVICES": strings.Join(c.DevicesIds, ",")},
			Mounts: p.mounts,
		})
	}
	return resp, nil
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s deviceplugin: %s\n", time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}

func inode(path string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0
	}
	return st.Ino
}

// serve listens on sock and registers with the kubelet; it returns the server to stop on a
// kubelet restart.
func serve(p *devicePlugin, dir, sock string) (*grpc.Server, error) {
	path := filepath.Join(dir, sock)
	_ = os.Remove(path)
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		srv.Stop()
		return nil, fmt.Errorf("dial kubelet.sock in %s: %w", dir, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     sock,
		ResourceName: p.resource,
	})
	if err != nil {
		srv.Stop()
		return nil, fmt.Errorf("register %s with the kubelet: %w", p.resource, err)
	}
	logf("registered %s (%d devices) on %s", p.resource, p.devices, path)
	return srv, nil
}

func runDevicePlugin(args []string) int {
	fs := flag.NewFlagSet("deviceplugin", flag.ContinueOnError)
	resource := fs.String("resource", "rdma/hca_shared_devices_a", "extended resource name to advertise")
	devices := fs.Int("devices", 4, "number of devices")
	dir := fs.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	sock := fs.String("socket", "fg-rdma.sock", "this plugin's socket file name in -dir")
	mount := fs.String("mount", "", "HOST:CONTAINER directory bind-mounted (read-only) into every container given a device, "+
		"as the RDMA shared device plugin hands out /dev/infiniband")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	p := &devicePlugin{resource: *resource, devices: *devices, healthy: true, changed: make(chan struct{})}
	if *mount != "" {
		host, ctr, ok := strings.Cut(*mount, ":")
		if !ok || !filepath.IsAbs(host) || !filepath.IsAbs(ctr) {
			fmt.Fprintf(os.Stderr, "deviceplugin: -mount %q: want HOST:CONTAINER, both absolute\n", *mount)
			return 2
		}
		p.mounts = []*pluginapi.Mount{{HostPath: host, ContainerPath: ctr, ReadOnly: true}}
	}

	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)

	var srv *grpc.Server
	var kubeletIno uint64
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		// (Re-)register when the kubelet's socket is new (kubelet restart) or ours was removed
		// (the kubelet clears the directory when it starts).
		ino := inode(filepath.Join(*dir, "kubelet.sock"))
		if ino != 0 && (ino != kubeletIno || inode(filepath.Join(*dir, *sock)) == 0) {
			if srv != nil {
				srv.Stop()
				srv = nil
			}
			s, err := serve(p, *dir, *sock)
			if err != nil {
				logf("%v (retrying)", err)
			} else {
				srv, kubeletIno = s, ino
			}
		}
		select {
		case <-usr1:
			logf("SIGUSR1: devices now healthy=%v", p.toggle())
		case <-stop:
			if srv != nil {
				srv.Stop()
			}
			_ = os.Remove(filepath.Join(*dir, *sock))
			return 0
		case <-tick.C:
		}
	}
}
