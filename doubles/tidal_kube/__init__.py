"""Kubernetes test and demo doubles: an API server in one process, a scheduler and a kubelet.
The product never imports them; the tests and the one-machine cluster (tidal_local) do.

- the emulator: :mod:`.serving` runs one (``EmulatorThread``, ``serve``, ``write_kubeconfig``,
  ``load_manifests``), :mod:`.emulator` from the command line (``python -m
  tidal_kube.emulator``); :mod:`.apiserver` is the server (``Emulator``) and names the modules
  of each of its concerns;
- the cluster behind it: :mod:`.scheduler` binds pods to nodes by GPUs, :mod:`.kubelet` runs
  them, both over the client of :mod:`.clusterapi`; :mod:`.localcluster` makes GPU nodes and
  runs the two together.
"""
