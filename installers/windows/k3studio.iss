; Inno Setup 6.3+ script: a setup program for the one-folder K3 Studio bundle.
;
; On Windows, from the checkout (docs/installers.md, "Windows"):
;   pyinstaller --noconfirm --distpath dist --workpath build\pyinstaller installers\k3studio.spec
;       -> dist\K3Studio\ (K3Studio.exe, k3.exe, _internal\)
;   iscc installers\windows\k3studio.iss
;       -> dist\K3Studio-<version>-setup.exe
; Overrides: iscc /DAppVersion=0.2.0 /DBundleDir=C:\path\to\K3Studio /DIconFile=k3studio.ico
;
; The installer copies the bundle as it is: nothing is compiled or downloaded on the target
; machine, and no Python is needed there.  Installs per user by default (no admin prompt);
; the wizard offers a machine-wide install.  Uninstall removes the program folder; the
; per-user data (%APPDATA%\K3 Studio: settings, the demo model) is left in place.
;
; Verified on Linux only: the structure this file must have (tests/test_installers.py);
; it has not been compiled by ISCC here.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#ifndef BundleDir
  #define BundleDir "..\..\dist\K3Studio"
#endif
#define AppName "K3 Studio"
#define AppExe "K3Studio.exe"
#define CliExe "k3.exe"

[Setup]
AppId={{C02497F4-549B-4FA9-9C1D-F94EAEEEAD9A}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=K3 Studio
VersionInfoVersion={#AppVersion}
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\..\dist
OutputBaseFilename=K3Studio-{#AppVersion}-setup
#ifdef IconFile
SetupIconFile={#IconFile}
#endif
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName={#AppName}
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
; the whole one-folder bundle: K3Studio.exe, k3.exe and _internal\ (Python, the compiled
; kernels, Qt, the tokenizer data and the app's resources)
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{userdocs}"
Name: "{group}\{#AppName} (demo model)"; Filename: "{app}\{#AppExe}"; Parameters: "--demo"; WorkingDir: "{userdocs}"
; a console with k3.exe (the command line) on its PATH, in Documents (k3 writes k3_run.json
; to the current folder, and Program Files is read-only); it starts with k3 --help
Name: "{group}\K3 command line"; Filename: "{cmd}"; Parameters: "/k set ""PATH={app};%PATH%"" && {#CliExe} --help"; WorkingDir: "{userdocs}"
Name: "{group}\{cm:UninstallProgram,{#AppName}}"; Filename: "{uninstallexe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; WorkingDir: "{userdocs}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Parameters: "--demo"; Description: "{cm:LaunchProgram,{#AppName}} (demo model)"; Flags: nowait postinstall skipifsilent
