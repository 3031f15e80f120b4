// Command fakegpu-dra is the real node's DRA kubelet plugin for its simulated GPUs.
//
// It registers with the kubelet as driver gpu.nvidia.com (the name localnode and the operator
// use), publishes the node's devices in one ResourceSlice (pool: the node's name), and
// prepares a claim by naming, for each device allocated to it on this node, the CDI device
// "<cdi kind>=<device>". The CDI specification those names resolve in (the device's directory
// mounted and the environment that points the worker at it) is written by the harness into
// the container runtime's CDI directory before the node starts.
//
// Its configuration is a JSON file (see config); its credentials are the node's own
// kubeconfig (the Node authorizer lets a node publish its own slices and read the claims of
// its pods).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

type device struct {
	Name        string `json:"name"`
	UUID        string `json:"uuid"`
	Index       int64  `json:"index"`
	ProductName string `json:"productName"`
	Memory      int64  `json:"memory"`
}

type config struct {
	Driver  string   `json:"driver"`
	Node    string   `json:"node"`
	CDIKind string   `json:"cdiKind"`
	Devices []device `json:"devices"`
}

type plugin struct {
	cfg config
}

func (p *plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		var result kubeletplugin.PrepareResult
		if claim.Status.Allocation == nil {
			result.Err = fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
			out[claim.UID] = result
			continue
		}
		for _, r := range claim.Status.Allocation.Devices.Results {
			if r.Driver != p.cfg.Driver || r.Pool != p.cfg.Node {
				continue
			}
			result.Devices = append(result.Devices, kubeletplugin.Device{
				Requests:     []string{r.Request},
				PoolName:     r.Pool,
				DeviceName:   r.Device,
				CDIDeviceIDs: []string{p.cfg.CDIKind + "=" + r.Device},
			})
		}
		klog.FromContext(ctx).Info("prepared", "claim", klog.KObj(claim), "devices", len(result.Devices))
		out[claim.UID] = result
	}
	return out, nil
}

func (p *plugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		out[claim.UID] = nil // nothing was set up per claim: the CDI devices are static
	}
	return out, nil
}

func (p *plugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func slice(cfg config) resourceslice.DriverResources {
	devices := make([]resourceapi.Device, 0, len(cfg.Devices))
	for _, d := range cfg.Devices {
		devices = append(devices, resourceapi.Device{
			Name: d.Name,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":        {StringValue: ptr.To("gpu")},
				"uuid":        {StringValue: ptr.To(d.UUID)},
				"index":       {IntValue: ptr.To(d.Index)},
				"productName": {StringValue: ptr.To(d.ProductName)},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: *resource.NewQuantity(d.Memory, resource.BinarySI)},
			},
		})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		cfg.Node: {Slices: []resourceslice.Slice{{Devices: devices}}},
	}}
}

func run() error {
	configPath := flag.String("config", "", "the plugin's JSON configuration")
	kubeconfig := flag.String("kubeconfig", "", "the node's kubeconfig")
	registryDir := flag.String("registry-dir", "", "the kubelet's plugins_registry directory")
	pluginDir := flag.String("plugin-dir", "", "where the plugin's DRA socket is created")
	klog.InitFlags(nil)
	flag.Parse()
	raw, err := os.ReadFile(*configPath)
	if err != nil {
		return err
	}
	var cfg config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return fmt.Errorf("%s: %w", *configPath, err)
	}
	rest, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(rest)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*pluginDir, 0o750); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	helper, err := kubeletplugin.Start(ctx, &plugin{cfg: cfg},
		kubeletplugin.KubeClient(client),
		kubeletplugin.DriverName(cfg.Driver),
		kubeletplugin.NodeName(cfg.Node),
		kubeletplugin.RegistrarDirectoryPath(*registryDir),
		kubeletplugin.PluginDataDirectoryPath(*pluginDir),
	)
	if err != nil {
		return err
	}
	defer helper.Stop()
	if err := helper.PublishResources(ctx, slice(cfg)); err != nil {
		return err
	}
	klog.Info("serving", "driver", cfg.Driver, "node", cfg.Node, "devices", len(cfg.Devices))
	<-ctx.Done()
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fakegpu-dra:", err)
		os.Exit(1)
	}
}
