package main

// A DRA kubelet plugin for the node tests (tests/node.rs), built on Kubernetes' own
// k8s.io/dynamic-resource-allocation/kubeletplugin library, that publishes the RDMA HCAs of a
// sysfs tree (a fixture's, tests/fixtures/*/sys) in the format of DraNet
// (kubernetes-sigs/dranet), the public RDMA NIC DRA driver:
//
//   - driver dra.net, one ResourceSlice for the node: pool = node name, spec.nodeName set,
//     owned by the Node (the library's ResourceSlice controller);
//   - device names pci-<PCI address> with ':' and '.' as '-' (DraNet's pkg/names/names.go);
//   - attributes (DraNet's pkg/apis/attributes.go, filled as pkg/inventory/db.go does):
//     dra.net/rdma (true), dra.net/rdmaDevice (mlx5_0), dra.net/pciAddress,
//     dra.net/numaNode (int, when the function has a NUMA node), dra.net/ifName,
//     dra.net/mtu and dra.net/state when the function has a netdev (RoCE), and the standard
//     resource.kubernetes.io/numaNode and resource.kubernetes.io/pcieRoot (from the library's
//     deviceattribute package, as DraNet does);
//   - no taints in the slice, the DRA health service off (as DraNet).
//
// Prepare/Unprepare return the allocated devices with no CDI device IDs (containerd 1.6 has
// no CDI). Only HCAs are published: DraNet also publishes plain netdevs, which the tests do not
// use. Test infrastructure only.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
)

// DraNet's attribute names (pkg/apis/attributes.go), under its driver name.
const (
	draNetDomain   = "dra.net"
	attrIfName     = draNetDomain + "/ifName"
	attrPCIAddress = draNetDomain + "/pciAddress"
	attrNUMANode   = draNetDomain + "/numaNode"
	attrMTU        = draNetDomain + "/mtu"
	attrState      = draNetDomain + "/state"
	attrRDMA       = draNetDomain + "/rdma"
	attrRDMADevice = draNetDomain + "/rdmaDevice"
)

var bdf = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$`)

// pciDeviceName is DraNet's device name for a PCI function (pkg/names/names.go).
func pciDeviceName(pciAddress string) string {
	return "pci-" + strings.NewReplacer(":", "-", ".", "-").Replace(pciAddress)
}

// busFS is a sysfs tree with bus/pci/devices/<address> links added where the tree has none (the
// fixtures keep only class/ and devices/), so the library's deviceattribute helpers can resolve
// a function's PCIe root as they do on a real /sys.
type busFS struct {
	fs.ReadLinkFS
	links map[string]string // bus/pci/devices/<address> -> ../../../devices/...
}

func (b busFS) ReadLink(name string) (string, error) {
	if target, ok := b.links[name]; ok {
		return target, nil
	}
	return b.ReadLinkFS.ReadLink(name)
}

// hca is one RDMA device of the tree.
type hca struct {
	name, pciAddress, pciDir string // pciDir relative to the sysfs root
}

// listHCAs reads class/infiniband/* of root: each link names the PCI function the device is on.
func listHCAs(root string) ([]hca, error) {
	entries, err := os.ReadDir(filepath.Join(root, "class", "infiniband"))
	if err != nil {
		return nil, err
	}
	var out []hca
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join(root, "class", "infiniband", e.Name()))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", e.Name(), err)
		}
		// ../../devices/pci0000:0f/0000:10:01.0/0000:18:00.0/infiniband/mlx5_0
		dev := path.Clean(path.Join("class/infiniband", target))
		pciDir := path.Dir(path.Dir(dev))
		addr := path.Base(pciDir)
		if !strings.HasPrefix(dev, "devices/") || !bdf.MatchString(addr) {
			dralog("skipping %s: not on a PCI function (%s)", e.Name(), target)
			continue
		}
		out = append(out, hca{name: e.Name(), pciAddress: addr, pciDir: pciDir})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].pciAddress < out[j].pciAddress })
	return out, nil
}

func readTrimmed(root, rel string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}

// devices builds the slice's devices from the HCAs of root. extra, when non-empty, names an
// attribute (not DraNet's) set to the link layer of port 1 (InfiniBand or Ethernet).
func devices(root string, extra string) ([]resourceapi.Device, error) {
	hcas, err := listHCAs(root)
	if err != nil {
		return nil, err
	}
	links := map[string]string{}
	for _, h := range hcas {
		links["bus/pci/devices/"+h.pciAddress] = "../../../" + h.pciDir
	}
	sysfs := busFS{ReadLinkFS: os.DirFS(root).(fs.ReadLinkFS), links: links}
	var out []resourceapi.Device
	for _, h := range hcas {
		attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			attrRDMA:       {BoolValue: ptr(true)},
			attrRDMADevice: {StringValue: ptr(h.name)},
			attrPCIAddress: {StringValue: ptr(h.pciAddress)},
		}
		if s, ok := readTrimmed(root, path.Join(h.pciDir, "numa_node")); ok {
			if n, err := strconv.Atoi(s); err == nil && n >= 0 {
				attrs[attrNUMANode] = resourceapi.DeviceAttribute{IntValue: ptr(int64(n))}
				if a, err := deviceattribute.GetNUMANodeAttribute(n, deviceattribute.ScalarAttribute); err == nil {
					attrs[a.Name] = a.Value
				}
			}
		}
		if a, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(h.pciAddress, deviceattribute.WithFS(sysfs)); err == nil {
			attrs[a.Name] = a.Value
		} else {
			dralog("%s: no PCIe root: %v", h.name, err)
		}
		if nets, err := os.ReadDir(filepath.Join(root, h.pciDir, "net")); err == nil && len(nets) > 0 {
			ifName := nets[0].Name()
			attrs[attrIfName] = resourceapi.DeviceAttribute{StringValue: ptr(ifName)}
			netDir := path.Join(h.pciDir, "net", ifName)
			if s, ok := readTrimmed(root, path.Join(netDir, "mtu")); ok {
				if mtu, err := strconv.ParseInt(s, 10, 64); err == nil {
					attrs[attrMTU] = resourceapi.DeviceAttribute{IntValue: ptr(mtu)}
				}
			}
			if s, ok := readTrimmed(root, path.Join(netDir, "operstate")); ok {
				attrs[attrState] = resourceapi.DeviceAttribute{StringValue: ptr(s)}
			}
		}
		if extra != "" {
			if s, ok := readTrimmed(root, path.Join(h.pciDir, "infiniband", h.name, "ports/1/link_layer")); ok {
				attrs[resourceapi.QualifiedName(extra)] = resourceapi.DeviceAttribute{StringValue: ptr(s)}
			}
		}
		out = append(out, resourceapi.Device{Name: pciDeviceName(h.pciAddress), Attributes: attrs})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func ptr[T any](v T) *T { return &v }

type draPlugin struct {
	driver string
	cancel context.CancelFunc
}

// PrepareResourceClaims hands back the devices allocated to this driver, with no CDI devices.
func (p *draPlugin) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		var res kubeletplugin.PrepareResult
		if c.Status.Allocation != nil {
			for _, r := range c.Status.Allocation.Devices.Results {
				if r.Driver != p.driver {
					continue
				}
				res.Devices = append(res.Devices, kubeletplugin.Device{
					Requests:   []string{r.Request},
					PoolName:   r.Pool,
					DeviceName: r.Device,
				})
			}
		}
		dralog("prepare %s/%s (%s): %d devices", c.Namespace, c.Name, c.UID, len(res.Devices))
		out[c.UID] = res
	}
	return out, nil
}

func (p *draPlugin) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		dralog("unprepare %s (%s)", c.NamespacedName, c.UID)
		out[c.UID] = nil
	}
	return out, nil
}

func (p *draPlugin) HandleError(_ context.Context, err error, msg string) {
	dralog("%s: %v", msg, err)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		p.cancel()
	}
}

func (p *draPlugin) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

func runDRAPlugin(args []string) int {
	fs := flag.NewFlagSet("draplugin", flag.ContinueOnError)
	driver := fs.String("driver", draNetDomain, "DRA driver name")
	node := fs.String("node-name", "", "this node's name (the slice's pool and spec.nodeName)")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig of the client that publishes the slice")
	root := fs.String("kubelet-root", "/var/lib/kubelet", "the kubelet's root directory "+
		"(registration socket in plugins_registry/, service socket in plugins/<driver>/)")
	sysfsRoot := fs.String("sysfs-root", "/sys", "sysfs tree whose class/infiniband devices are published")
	extra := fs.String("link-layer-attribute", "", "also publish this attribute (not DraNet's) with port 1's "+
		"link layer, InfiniBand or Ethernet, to tell compute HCAs from storage ports; empty: off")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *node == "" || *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "draplugin: --node-name and --kubeconfig are required")
		return 2
	}
	devs, err := devices(*sysfsRoot, *extra)
	if err != nil {
		dralog("listing the HCAs of %s: %v", *sysfsRoot, err)
		return 1
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		dralog("kubeconfig: %v", err)
		return 1
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		dralog("client: %v", err)
		return 1
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := &draPlugin{driver: *driver, cancel: cancel}
	pluginDir := filepath.Join(*root, "plugins", *driver)
	if err := os.MkdirAll(pluginDir, 0o750); err != nil {
		dralog("%v", err)
		return 1
	}
	helper, err := kubeletplugin.Start(ctx, p,
		kubeletplugin.DriverName(*driver),
		kubeletplugin.NodeName(*node),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(filepath.Join(*root, "plugins_registry")),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		dralog("start: %v", err)
		return 1
	}
	defer helper.Stop()
	names := make([]string, 0, len(devs))
	for _, d := range devs {
		names = append(names, d.Name)
	}
	dralog("driver %s on %s: publishing %d devices %v", *driver, *node, len(devs), names)
	err = helper.PublishResources(ctx, resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{
			*node: {Slices: []resourceslice.Slice{{Devices: devs}}},
		},
	})
	if err != nil {
		dralog("publish: %v", err)
		return 1
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case s := <-stop:
		dralog("%v: stopping", s)
		return 0
	case <-ctx.Done():
		dralog("stopped after a fatal error")
		return 1
	}
}

func dralog(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s draplugin: %s\n", time.Now().UTC().Format("15:04:05.000"), fmt.Sprintf(format, args...))
}
