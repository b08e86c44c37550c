"""Kubernetes mode (`agent.mode: kubernetes`): nodeagent beside the kubelet and the GPU
device plugin. The kubelet's PodResources API says which GPUs each container holds, the
API server (optionally) what pods and namespaces are labelled now, and the node tells the
scheduler its GPU topology. The gRPC and Kubernetes client libraries are imported only in
this mode (the `kubernetes` extra)."""
