"""``tidal local``: the whole system on one machine (DESIGN.md section 6).

- :mod:`.cluster`: the API emulator, GPU nodes, scheduler, a kubelet that runs worker pods as
  ``tidal agent`` processes (:mod:`.processes`), the real ``tidal-operator``, and a generator
  of non-elastic GPU jobs (:mod:`.arrivals`);
- :mod:`.observe`: what the cluster looks like now, as the live view and the timeline see it;
- :mod:`.demo`: ``tidal local demo``, its report and plot; :mod:`.binaries`: kubectl and helm.

No torch and no tidal_agent here: agents are separate processes, started as a kubelet would.
"""
