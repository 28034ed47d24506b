"""Time and energy of a stretch of training, measured once per epoch.

bso's cost of a trial is ``eta * energy + (1 - eta) * MaxPower * time``
(:func:`bso.core.cost.cost`), so the training loop has to report both terms for
every epoch.  One module per energy source, behind one interface
(:mod:`~bso_client.energy.base`: :class:`EnergyMonitor` and its windows)::

    monitor = detect_monitor()          # NVML, else RAPL, else time only
    monitor.begin_window()
    train_one_epoch()
    elapsed_s, energy_j = monitor.end_window()

Three sources, best first; :func:`~bso_client.energy.detect.detect_monitor`
picks the best that works and says which:

* :mod:`~bso_client.energy.nvml`: the GPUs' own energy counters, or their
  sampled power where a GPU has no counter.
* :mod:`~bso_client.energy.rapl`: no usable GPU, so the CPU packages' energy
  from Linux RAPL.  ``MaxPower`` is then the packages' RAPL power limit (else
  ``default_max_power_w``).
* :mod:`~bso_client.energy.time_only`: nothing readable.  Energy is reported
  as 0, so the cost reduces to its time term; ``eta_knob`` must be below 1.

Each fallback is announced with an ``EnergyFallbackWarning``, and the hardware
the monitor reports gets a distinct ``gpu_model`` ("cpu" for RAPL,
"cpu-time-only") so that costs measured differently are never learned together.

Nothing here imports torch or pynvml: pynvml is imported when an NVML monitor
is built.  This ``__init__`` imports nothing either, so that using one source
loads only that source and the base; training scripts import the monitors from
:mod:`bso_client` itself.
"""
