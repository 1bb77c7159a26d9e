{{/* The chart's name, or nameOverride. */}}
{{- define "tidal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of namespaced object names: the release name, with the chart's name appended
unless the release name already contains it. */}}
{{- define "tidal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "tidal.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tidal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tidal
{{- end }}

{{/* What selects the operator's pod (Deployment, metrics Service, ServiceMonitor). */}}
{{- define "tidal.operatorSelector" -}}
app.kubernetes.io/name: {{ include "tidal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The namespaces where jobs run: the release's and workers.extraNamespaces. */}}
{{- define "tidal.jobNamespaces" -}}
{{- $namespaces := list .Release.Namespace }}
{{- range .Values.workers.extraNamespaces }}
{{- if not (has . $namespaces) }}
{{- $namespaces = append $namespaces . }}
{{- end }}
{{- end }}
{{- toJson $namespaces }}
{{- end }}

{{/* The operator's image: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "tidal.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}
