{{/* Names and labels. */}}
{{- define "tunerd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tunerd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tunerd.labels" -}}
{{ include "tunerd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
tunerd.toml as the daemon reads it: .Values.tunerd with the keys the chart owns set over it.
*/}}
{{- define "tunerd.config" -}}
{{- $forced := dict
  "door" (dict "host" "0.0.0.0")
  "export" (dict "host" "0.0.0.0" "enabled" true)
  "paths" (dict "state_dir" "/var/lib/tunerd") -}}
{{- $config := mustMergeOverwrite (deepCopy (.Values.tunerd | default dict)) $forced -}}
{{- if not (dig "door" "enabled" true $config) -}}
{{- fail "tunerd.door.enabled: the Service targets the front door's port; it must be on" -}}
{{- end -}}
{{- toJson $config -}}
{{- end -}}

{{/*
TOML from a map, written by hand: Helm's toToml writes every number of a values file as a float
(values are parsed as JSON numbers, `port = 8000.0`), which tunerd's strict types reject for an integer
key. Here a whole number is written as an integer (tunerd reads an integer as a float where a key is
one: `60` stands for `60.0`), a null is left out (tunerd's default applies), a map inside a section is a
[sub.table], a map inside a list an inline table.
*/}}
{{- define "tunerd.toml.key" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . }}{{ . }}{{ else }}{{ toJson . }}{{ end -}}
{{- end -}}

{{- define "tunerd.toml.value" -}}
{{- $v := . -}}
{{- if kindIs "string" $v -}}{{ toJson $v }}
{{- else if kindIs "bool" $v -}}{{ $v }}
{{- else if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if eq (float64 (int64 $v)) (float64 $v) }}{{ int64 $v }}{{ else }}{{ $v }}{{ end -}}
{{- else if kindIs "slice" $v -}}
[{{ range $i, $e := $v }}{{ if $i }}, {{ end }}{{ include "tunerd.toml.value" $e }}{{ end }}]
{{- else if kindIs "map" $v -}}
{ {{- range $i, $k := keys $v | sortAlpha }}{{ if $i }},{{ end }} {{ include "tunerd.toml.key" $k }} = {{ include "tunerd.toml.value" (get $v $k) }}{{ end }} }
{{- else -}}
{{- fail (printf "tunerd.toml: cannot write %v (a %s)" $v (kindOf $v)) -}}
{{- end -}}
{{- end -}}

{{/* One table: its plain keys, then its sub-tables. Argument: (list "dotted.path" map). */}}
{{- define "tunerd.toml.table" -}}
{{- $path := index . 0 -}}
{{- $table := index . 1 -}}
{{- range $k := keys $table | sortAlpha }}
{{- $v := get $table $k }}
{{- if and (not (kindIs "map" $v)) (not (kindIs "invalid" $v)) }}
{{ include "tunerd.toml.key" $k }} = {{ include "tunerd.toml.value" $v }}
{{- end }}
{{- end }}
{{- range $k := keys $table | sortAlpha }}
{{- $v := get $table $k }}
{{- if kindIs "map" $v }}
{{- $sub := ternary (include "tunerd.toml.key" $k) (printf "%s.%s" $path (include "tunerd.toml.key" $k)) (eq $path "") }}

[{{ $sub }}]
{{- include "tunerd.toml.table" (list $sub $v) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tunerd.toml" -}}
# tunerd.toml, written by the tunerd chart from its values (`tunerd:`); every key: etc/tunerd/tunerd.toml.
{{- include "tunerd.toml.table" (list "" (include "tunerd.config" . | fromJson)) }}
{{ end -}}

{{/* rules.toml: the values' text, else the rules tunerd ships. */}}
{{- define "tunerd.rules" -}}
{{- .Values.rules | default (.Files.Get "files/rules.toml") -}}
{{- end -}}

{{/* The drain and stop budget the grace period must exceed (seconds). */}}
{{- define "tunerd.stopBudget" -}}
{{- $config := include "tunerd.config" . | fromJson -}}
{{- $drain := dig "door" "drain_timeout_s" 30.0 $config | float64 -}}
{{- $stop := dig "timeouts" "graceful_stop_s" 30.0 $config | float64 -}}
{{- addf $drain $stop 10.0 -}}
{{- end -}}
